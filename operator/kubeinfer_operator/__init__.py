"""kubeinfer operator: reconciles InferenceModel (kubeinfer.dev/v1alpha1) into a served model.

Importing the package registers every kopf handler, so `kopf run -m kubeinfer_operator` works.
"""

from . import handlers as handlers

__all__ = ["handlers"]
