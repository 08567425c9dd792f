"""The activator: a small HTTP proxy in front of a scale-to-zero model (`scaling.minReplicas: 0`).

It holds requests while the model has no ready replica, wakes the model through its scale subresource,
sends the held requests on as replicas become ready (never more than each replica admits), and, on the
built-in path (no autoscaler), scales the model back to zero after `scaling.scaleDownDelaySeconds`
without requests. It runs as its own Deployment per model (render_activator.py), independent of the
operator and its leader election. Modules: `gate` (holding, plain asyncio), `scaler` (the API),
`proxy` (aiohttp), `controller` (the wake / idle loop), `metrics` (prometheus_client).
"""
