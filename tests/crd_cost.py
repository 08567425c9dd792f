"""An upper bound of each x-kubernetes-validations rule's cost as kube-apiserver estimates it when it
creates a CRD, in Python, for CI without an API server (issue 29 F2).

Written from the Kubernetes 1.36 sources (read, not copied):
- the schema -> CEL type mapping with each type's maximum size (k8s.io/apiserver/pkg/cel/common/
  schemas.go SchemaDeclType): a string holds maxLength*4 bytes (UTF-8), or maxRequestSize-2 (3 MiB)
  without maxLength; an enum string its longest value; a list maxItems elements, or
  (3 MiB - 2) / (element min size + 1) without; a map maxProperties entries, or (3 MiB - 2) /
  (value min size + 6); an int-or-string is like a string; a map's keys are apiservercel.StringType,
  whose size estimate is 0 (apiextensions' sizeEstimator returns the type's MaxElements);
- cel-go's static cost model (checker/cost.go, common/cost.go): 1 per identifier and field select,
  0 per literal, has() 1 + its operand, 1 + arguments for a call, `&&`/`||` the sum of both sides,
  `?:` condition + the dearer branch, list literal 10 + elements, `in` the list's size, string `==` and
  `<` 0.1 per byte of the shorter side, startsWith/endsWith 0.1 per byte of the argument,
  matches ceil(0.1*(len+1)) * ceil(0.25*len(regex)), contains ceil(0.1*len) * ceil(0.1*len(arg)),
  a comprehension its range, result and per element (loop step + loop condition);
- apiextensions' per-rule and per-CRD limits (pkg/apis/apiextensions/validation/validation.go):
  a rule's cost times its node's cardinality (the product of maxItems/maxProperties of the lists and
  maps above it, estimated from minimum sizes when unbounded) must stay within
  StaticEstimatedCostLimit, and the sum over all rules within StaticEstimatedCRDCostLimit.

Everything is an upper bound ("max" of cel-go's [min, max] estimates): where cel-go's own sizing is
more precise (e.g. a scalar's size 0), this one may say more, never less. A construct it does not
know raises, rather than under-estimating. Checked against the real numbers for our rules
(docs/operator.md).

Parsing uses cel-python's Lark grammar (celpy.CELParser), the parser only.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import celpy
from lark import Token, Tree

MAX_REQUEST_SIZE = 3 * 1024 * 1024  # celconfig.MaxRequestSizeBytes
STATIC_ESTIMATED_COST_LIMIT = 10_000_000  # per rule (x cardinality)
STATIC_ESTIMATED_CRD_COST_LIMIT = 100_000_000  # all rules of the CRD
UNKNOWN = 2**64 - 1  # cel-go's UnknownSizeEstimate / an overflowed cost
_STRING_FACTOR = 0.1
_REGEX_FACTOR = 0.25
_LIST_CREATE = 10
_MAP_CREATE = 30
_TYPE_NAMES = {"int", "uint", "double", "bool", "string", "bytes", "list", "map", "null_type", "type"}


@dataclass(frozen=True)
class Decl:
    """apiservercel.DeclType reduced to what the estimator reads: kind, max_elements (a string's
    bytes, a list's items, a map's entries; 0 for scalars and objects), min serialized size."""

    kind: str  # object | list | map | string | dyn | int | double | bool
    max_elements: int = 0
    min_size: int = 1
    fields: dict[str, Decl] = field(default_factory=dict)
    elem: Decl | None = None
    key: Decl | None = None


def _max_string(schema: dict[str, Any]) -> int:
    if "maxLength" in schema:
        return max(0, int(schema["maxLength"])) * 4
    if schema.get("enum") and not schema.get("x-kubernetes-int-or-string"):
        return max(len(str(v)) for v in schema["enum"])
    fmt = schema.get("format")
    if not schema.get("x-kubernetes-int-or-string") and fmt in ("duration", "date-time"):
        return 32
    if not schema.get("x-kubernetes-int-or-string") and fmt == "date":
        return 12
    return MAX_REQUEST_SIZE - 2


def decl(schema: dict[str, Any]) -> Decl:
    """SchemaDeclType: the CEL type of a structural schema node with its size bounds."""
    if schema.get("x-kubernetes-int-or-string"):
        return Decl("dyn", _max_string(schema), 1)
    kind = schema.get("type")
    if kind == "array":
        elem = decl(schema.get("items") or {})
        count = schema.get("maxItems")
        n = int(count) if count is not None else (MAX_REQUEST_SIZE - 2) // (elem.min_size + 1)
        return Decl("list", max(0, n), 2, elem=elem)
    if kind == "object":
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            value = decl(extra)
            count = schema.get("maxProperties")
            n = int(count) if count is not None else (MAX_REQUEST_SIZE - 2) // (value.min_size + 6)
            return Decl("map", max(0, n), 2, elem=value, key=Decl("string", 0, 2))
        required = set(schema.get("required") or [])
        fields = {}
        min_size = 2
        for name, sub in (schema.get("properties") or {}).items():
            fields[name] = decl(sub)
            if name in required and "default" not in sub:
                min_size += len(name) + fields[name].min_size + 4
        return Decl("object", 0, min_size, fields=fields)
    if kind == "string":
        fmt = schema.get("format")
        min_size = {"duration": 3, "date": 12, "date-time": 21}.get(fmt or "", 2)
        return Decl("string", _max_string(schema), min_size)
    if kind == "boolean":
        return Decl("bool", 0, 4)
    if kind == "number":
        return Decl("double", 0, 1)
    if kind == "integer":
        return Decl("int", 0, 1)
    return Decl("dyn", MAX_REQUEST_SIZE - 2, 1)  # untyped (preserve-unknown-fields): as large as a request


@dataclass(frozen=True)
class _Est:
    cost: int  # upper bound
    size: int | None  # upper bound of the value's size (bytes, items), None: unknown
    decl: Decl | None = None  # the schema type, when the expression is a path into self
    literal: Any = None
    elem_size: int | None = None  # a list literal's largest element


def _add(*xs: int) -> int:
    return min(UNKNOWN, sum(xs))


def _mul(a: int, b: int) -> int:
    return min(UNKNOWN, a * b)


def _factor(x: int, f: float) -> int:
    return UNKNOWN if x >= UNKNOWN else min(UNKNOWN, math.ceil(x * f))


def _size(e: _Est) -> int:
    return UNKNOWN if e.size is None else e.size


class UnsupportedRule(ValueError):
    """The rule uses CEL this estimator does not model: extend it rather than guess low."""


class _Coster:
    def __init__(self, root: Decl) -> None:
        self.root = root
        self.locals: list[dict[str, _Est]] = []

    def _local(self, name: str) -> _Est | None:
        for scope in reversed(self.locals):
            if name in scope:
                return scope[name]
        return None

    # --- grammar walk ---------------------------------------------------------------------------
    def cost(self, node: Tree | Token) -> _Est:
        if isinstance(node, Token):
            raise UnsupportedRule(f"unexpected token {node!r}")
        rule = node.data
        kids = node.children
        if rule in ("expr",):
            if len(kids) == 3 and kids[1] is not None:
                cond, yes, no = (self.cost(k) for k in kids)
                size = None if yes.size is None or no.size is None else max(yes.size, no.size)
                return _Est(_add(cond.cost, max(yes.cost, no.cost)), size)
            return self.cost(kids[0])
        if rule in ("conditionalor", "conditionaland"):
            if len(kids) == 2 and kids[0] is not None:
                lhs, rhs = self.cost(kids[0]), self.cost(kids[1])
                return _Est(_add(lhs.cost, rhs.cost), 1)
            return self.cost(kids[-1])
        if rule == "relation":
            if len(kids) == 2 and kids[0] is not None:
                op = kids[0]
                lhs, rhs = self.cost(op.children[0]), self.cost(kids[1])
                return self._relation(op.data, lhs, rhs)
            return self.cost(kids[-1])
        if rule in ("addition", "multiplication"):
            if len(kids) == 2 and kids[0] is not None:
                op = kids[0]
                lhs, rhs = self.cost(op.children[0]), self.cost(kids[1])
                if op.data == "addition_add" and (lhs.decl is None or lhs.decl.kind != "int"):
                    # string or list concatenation: 0.1 per byte of the result (strings), 1 (lists)
                    size = None if lhs.size is None or rhs.size is None else lhs.size + rhs.size
                    return _Est(
                        _add(lhs.cost, rhs.cost, _factor(_size(_Est(0, size)), _STRING_FACTOR), 1), size
                    )
                return _Est(_add(lhs.cost, rhs.cost, 1), 1)
            return self.cost(kids[-1])
        if rule == "unary":
            if len(kids) == 2:
                inner = self.cost(kids[1])
                return _Est(_add(inner.cost, 1), 1)
            return self.cost(kids[0])
        if rule == "member":
            return self.cost(kids[0])
        if rule == "member_dot":
            target, name = self.cost(kids[0]), str(kids[1])
            sub = target.decl.fields.get(name) if target.decl and target.decl.kind == "object" else None
            return self._value(_add(target.cost, 1), sub)
        if rule == "member_dot_arg":
            return self._method(kids[0], str(kids[1]), kids[2])
        if rule == "member_index":
            target, index = self.cost(kids[0]), self.cost(kids[1])
            elem = target.decl.elem if target.decl and target.decl.kind in ("list", "map") else None
            return self._value(_add(target.cost, index.cost, 1), elem)
        if rule == "primary":
            return self.cost(kids[0])
        if rule == "paren_expr":
            return self.cost(kids[0])
        if rule == "literal":
            text = str(kids[0])
            if text[:1] in "'\"" or text[:2].lower() in ("r'", 'r"'):
                raw = text[1:] if text[0] in "rR" else text
                quote = raw[:3] if raw[:3] in ("'''", '"""') else raw[0]
                body = raw[len(quote) : -len(quote)]
                return _Est(0, len(body), literal=body)
            return _Est(0, 1)
        if rule == "ident":
            name = str(kids[0])
            local = self._local(name)
            if local is not None:
                return _Est(1, local.size, local.decl)
            if name == "self":
                return self._value(1, self.root)
            if name in _TYPE_NAMES:
                return _Est(1, 1)
            raise UnsupportedRule(f"unknown identifier {name}")
        if rule == "ident_arg":
            return self._function(str(kids[0]), kids[1])
        if rule == "list_lit":
            items = [self.cost(e) for e in (kids[0].children if kids and kids[0] is not None else [])]
            sizes = [i.size for i in items]
            elem_size = None if None in sizes else max((s for s in sizes if s is not None), default=0)
            return _Est(_add(_LIST_CREATE, *(i.cost for i in items)), len(items), elem_size=elem_size)
        if rule == "map_lit":
            inits = kids[0].children if kids and kids[0] is not None else []
            parts = [self.cost(e) for e in inits]
            return _Est(_add(_MAP_CREATE, *(p.cost for p in parts)), len(inits) // 2)
        raise UnsupportedRule(f"CEL construct {rule} is not modelled")

    def _value(self, cost: int, d: Decl | None) -> _Est:
        if d is None:
            return _Est(cost, None)
        if d.kind in ("int", "double", "bool"):
            return _Est(cost, 1, d)  # cel-go: a scalar's size is at most 1 (it says 0 through the schema)
        return _Est(cost, d.max_elements, d)

    def _args(self, exprlist: Tree | None) -> list[Tree]:
        return list(exprlist.children) if exprlist is not None else []

    def _relation(self, op: str, lhs: _Est, rhs: _Est) -> _Est:
        base = _add(lhs.cost, rhs.cost)
        if op == "relation_in":
            return _Est(_add(base, _size(rhs)), 1)
        # ==, !=, <, <=, >, >= : 0.1 per byte of the smaller side (strings, bytes, lists...), scalars 1
        smallest = min(_size(lhs), _size(rhs))
        return _Est(_add(base, max(1, _factor(smallest, _STRING_FACTOR))), 1)

    def _method(self, target_node: Tree, name: str, exprlist: Tree | None) -> _Est:
        args = self._args(exprlist)
        if name in ("exists", "all", "exists_one", "map", "filter"):
            return self._comprehension(target_node, name, args)
        target = self.cost(target_node)
        costs = [self.cost(a) for a in args]
        arg_cost = _add(target.cost, *(c.cost for c in costs))
        if name == "matches" and len(costs) == 1:
            str_cost = _factor(_add(_size(target), 1), _STRING_FACTOR)
            return _Est(_add(arg_cost, _mul(str_cost, _factor(_size(costs[0]), _REGEX_FACTOR))), 1)
        if name in ("startsWith", "endsWith") and len(costs) == 1:
            return _Est(_add(arg_cost, _factor(_size(costs[0]), _STRING_FACTOR)), 1)
        if name == "contains" and len(costs) == 1:
            c = _mul(_factor(_size(target), _STRING_FACTOR), _factor(_size(costs[0]), _STRING_FACTOR))
            return _Est(_add(arg_cost, c), 1)
        if name == "size" and not costs:
            return _Est(_add(arg_cost, 1), 1)
        raise UnsupportedRule(f"method {name}() is not modelled")

    def _function(self, name: str, exprlist: Tree | None) -> _Est:
        args = self._args(exprlist)
        if name == "has" and len(args) == 1:
            # presence test 1 + the select's operand: what the select itself costs (operand + 1)
            return _Est(self.cost(args[0]).cost, 1)
        costs = [self.cost(a) for a in args]
        if name in ("size", "type", "int", "uint", "double", "bool", "dyn") and len(costs) == 1:
            return _Est(_add(costs[0].cost, 1), 1 if name != "dyn" else costs[0].size, costs[0].decl)
        if name == "string" and len(costs) == 1:
            return _Est(_add(costs[0].cost, 1), costs[0].size)
        raise UnsupportedRule(f"function {name}() is not modelled")

    def _comprehension(self, target_node: Tree, macro: str, args: list[Tree]) -> _Est:
        rng = self.cost(target_node)
        if len(args) != 2:
            raise UnsupportedRule(f"{macro}() with {len(args)} arguments is not modelled")
        var = _var_name(args[0])
        d = rng.decl
        if d is not None and d.kind == "list":
            elem = self._value(0, d.elem)
        elif d is not None and d.kind == "map":
            elem = self._value(0, d.key)
        else:
            # a list literal (its largest element), else unknown: every use is priced as unknown
            elem = _Est(0, rng.elem_size)
        self.locals.append({var: _Est(1, elem.size, elem.decl)})
        try:
            body = self.cost(args[1])
        finally:
            self.locals.pop()
        # exists/all: loop step `__result__ op body` (1 + body), loop condition
        # `@not_strictly_false(!__result__)` (3), result `__result__` (1); the others are dearer per
        # step by a constant: 5 is above each.
        overhead = 3 if macro in ("exists", "all") else 5
        count = _size(rng)
        return _Est(_add(rng.cost, 1, _mul(count, _add(body.cost, 1, overhead))), 1)


def _var_name(node: Tree) -> str:
    for sub in node.iter_subtrees():
        if sub.data == "ident":
            return str(sub.children[0])
    raise UnsupportedRule("a macro's variable must be an identifier")


_PARSER = celpy.CELParser()


def rule_cost(rule: str, node: dict[str, Any]) -> int:
    """Upper bound of one rule's estimated cost on its schema node (one evaluation)."""
    return _Coster(decl(node)).cost(_PARSER.parse(rule)).cost


@dataclass(frozen=True)
class RuleCost:
    """One rule's estimate: per evaluation, how many times it can run per object (its node's
    cardinality), and their product, which the API server compares with STATIC_ESTIMATED_COST_LIMIT."""

    path: str
    rule: str
    message: str
    cost: int
    cardinality: int
    field_path: str = ""  # the API server's spelling: properties[spec].x-kubernetes-validations[0].rule

    @property
    def total(self) -> int:
        return _mul(self.cost, self.cardinality)


def rule_costs(schema: dict[str, Any]) -> list[RuleCost]:
    """Every rule of the schema (an openAPIV3Schema) with its estimate, in schema order."""
    return list(_walk(schema, "", "", 1))


def _walk(node: dict[str, Any], path: str, fpath: str, cardinality: int) -> Iterator[RuleCost]:
    for i, r in enumerate(node.get("x-kubernetes-validations") or []):
        where = (
            f"{fpath}.x-kubernetes-validations[{i}].rule" if fpath else f"x-kubernetes-validations[{i}].rule"
        )
        cost = rule_cost(r["rule"], node)
        yield RuleCost(path, r["rule"], r.get("message", r["rule"]), cost, cardinality, where)
    for key, sub in (node.get("properties") or {}).items():
        sub_f = f"{fpath}.properties[{key}]" if fpath else f"properties[{key}]"
        yield from _walk(sub, f"{path}.{key}" if path else key, sub_f, cardinality)
    items = node.get("items")
    if isinstance(items, dict):
        count = node.get("maxItems")
        n = int(count) if count is not None else MAX_REQUEST_SIZE // (decl(items).min_size + 1)
        yield from _walk(items, f"{path}[]", f"{fpath}.items", _mul(cardinality, n))
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        count = node.get("maxProperties")
        n = int(count) if count is not None else MAX_REQUEST_SIZE // (decl(extra).min_size + 1)
        yield from _walk(extra, f"{path}{{}}", f"{fpath}.additionalProperties", _mul(cardinality, n))


def budget_message(what: str, cost: int, limit: int) -> str:
    """getCostErrorMessage's wording (apiextensions validation.go)."""
    factor = cost / limit
    if factor > 100:
        text = "more than 100x"
    elif factor < 1.5:
        text = f"{factor:f}x"
    else:
        text = f"{factor:.1f}x"
    return (
        f"{what} exceeds budget by factor of {text} (try simplifying the rule, or adding maxItems, "
        "maxProperties, and maxLength where arrays, maps, and strings are declared)"
    )


def total_cost(schema: dict[str, Any]) -> int:
    """The CRD's total, which the API server compares with STATIC_ESTIMATED_CRD_COST_LIMIT."""
    return min(UNKNOWN, sum(r.total for r in rule_costs(schema)))
