"""Chat templates without jinja for one-turn prompts: render once with a placeholder, splice each text in.

jinja is a large share of qbatch's own CPU time per row; most rows are one
user turn, plus the job's system prompt, that differ only in their text. So the template
is rendered once per (system prompt, thinking) with a placeholder text, and each row's text
takes the placeholder's place. That is right only where the template inserts the text
verbatim and never branches on it, so a splice is used only when all of this holds:

- the template, read as jinja's syntax tree, uses a message's content only in ways listed
  in `_follow` (output, concatenation, truthiness and type tests, `==` a constant,
  `'x' in content`, `startswith`/`endswith`, `split('x')[0|-1]`, stripping whitespace);
- the row's text is non-empty, neither starts nor ends with whitespace, equals none of the
  constants it is compared with and contains none of the substrings it is searched for
  (such a text is rendered by jinja, as is any other conversation);
- for each (system prompt, thinking), the splice equals the real render on `PROBES` and on
  texts built from every constant of the template, checked before its first use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jinja2 import nodes

PLACEHOLDER = "\ue000qbatch-text\ue001"  # private-use characters: in no template, no trigger
MAX_KEYS = 64  # (system prompt, thinking) pairs learned; others are rendered by jinja
PROBES = (
    "Hello", "a", "What is 2+2?", "0", "None", "null", "true", "user", "system", "assistant", "tool", "content",
    "line one\nline two\n\n\nline three", "tab\tinside\r\nCRLF", 'quotes "double" and \'single\'',
    "back\\slash \\n \\u0041", "{{ braces }} {% if x %}jinja{% endif %} {# comment #} {%- raw -%}",
    "{'role': 'user', 'content': 'x'}", '{"a": [1, 2], "b": null}', "%s %(x)s {0} $x",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<think>\nreasoning\n</think>\n\nanswer",
    "</think>", "<tool_response>\n{}\n</tool_response>", "<tool_call>\n{}\n</tool_call>", "<|endoftext|><s></s>",
    "ünïcødé — 中文 — emoji 🙂", "zero\u200bwidth\u00a0nbsp", "x" * 100_000, "word " * 2_000 + "end",
)
SAFE_TESTS = {"defined", "undefined", "none", "string"}  # about the value's type only
STRIP_METHODS = {"strip", "lstrip", "rstrip"}
TEST_METHODS = {"startswith", "endswith"}
REFUSED_NODES = ("Macro", "CallBlock", "FilterBlock", "AssignBlock", "Include", "Import", "FromImport", "Extends",
                 "Block", "With", "Scope", "OverlayScope", "EvalContextModifier", "ScopedEvalContextModifier")
# Filters that turn a message into text without naming `content` (so content would escape this check).
REFUSED_FILTERS = {"dictsort", "items", "pprint", "string", "join", "map", "sum", "unique", "min", "max", "xmlattr",
                   "groupby", "attr"}
SAFE_CALLS = {"raise_exception", "namespace", "range", "dict"}  # not strftime_now: the date changes


@dataclass(frozen=True)
class ContentUses:
    """What the template asks about a content: texts that equal or contain these are rendered by jinja."""

    constants: frozenset[str]
    substrings: frozenset[str]
    literals: frozenset[str]  # every string constant of the template, for probes


class _Refused(Exception):
    """The template uses content in a way a splice cannot reproduce."""


def content_uses(template: str) -> ContentUses | None:
    """How `template` uses message contents; None when a splice could differ from its render."""
    from jinja2 import TemplateSyntaxError, nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    try:
        tree = env.parse(template)
    except TemplateSyntaxError:  # e.g. transformers' {% generation %} tag: leave such templates to jinja
        return None
    parents = {id(child): node for node in tree.find_all(nodes.Node) for child in node.iter_child_nodes()}
    found = _Found(parents)
    try:
        _check_structure(tree, parents)
        reads = [n for n in tree.find_all((nodes.Getattr, nodes.Getitem)) if _is_content_read(n)]
        for read in reads:
            found.follow(read, derived=False)
        found.follow_names(tree)
    except _Refused:
        return None
    literals = {n.value for n in tree.find_all(nodes.Const) if isinstance(n.value, str)}
    return ContentUses(frozenset(found.constants), frozenset(s for s in found.substrings if s), frozenset(literals))


def _is_content_read(node: Any) -> bool:
    from jinja2 import nodes

    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    return isinstance(node.arg, nodes.Const) and node.arg.value == "content"


def _check_structure(tree: Any, parents: dict[int, Any]) -> None:
    """Refuse constructs through which content could be read or captured unseen."""
    from jinja2 import nodes

    for node in tree.find_all(nodes.Node):
        if type(node).__name__ in REFUSED_NODES:
            raise _Refused(type(node).__name__)
        if isinstance(node, nodes.Filter) and node.name in REFUSED_FILTERS:
            raise _Refused(f"filter {node.name}")
        if isinstance(node, nodes.Call):
            callee = node.node
            if isinstance(callee, nodes.Name) and callee.name not in SAFE_CALLS:
                raise _Refused(f"call {callee.name}")
            if isinstance(callee, nodes.Getattr) and callee.attr in ("items", "values", "get"):
                raise _Refused(f"method {callee.attr}")
        if isinstance(node, nodes.Const) and node.value == "content":
            parent = parents.get(id(node))
            if isinstance(parent, nodes.Getitem) and parent.arg is node:
                continue
            if isinstance(parent, nodes.Compare) and parent.expr is node and [o.op for o in parent.ops] in (["in"], ["notin"]):
                continue  # 'content' in message: a key test, true for every message qbatch renders
            raise _Refused("'content' used other than as a key")


class _Found:
    """Follows each content read up the tree to where it ends, collecting the triggers."""

    def __init__(self, parents: dict[int, Any]):
        self.parents = parents
        self.constants: set[str] = set()
        self.substrings: set[str] = set()
        self.names: dict[str, bool] = {}  # variables holding a content -> derived (concatenated) or not

    def follow_names(self, tree: Any) -> None:
        from jinja2 import nodes

        checked: dict[str, bool] = {}
        while pending := [(n, d) for n, d in self.names.items() if checked.get(n) != d]:
            for name, derived in pending:
                checked[name] = derived
                for load in tree.find_all(nodes.Name):
                    if load.name == name and load.ctx == "load":
                        self.follow(load, derived=derived)

    def follow(self, node: Any, *, derived: bool) -> None:
        """Climb from a content (or a value made from it) to its use; raise _Refused if not allowed."""
        from jinja2 import nodes

        while True:
            parent = self.parents.get(id(node))
            if isinstance(parent, nodes.Operand):
                parent = self.parents.get(id(parent))
            if isinstance(parent, nodes.Output):
                return
            if isinstance(parent, (nodes.Add, nodes.Concat)):
                node, derived = parent, True  # content inside a longer string: only output and truthiness allowed
            elif isinstance(parent, (nodes.And, nodes.Or)) or (isinstance(parent, nodes.CondExpr) and node is not parent.test):
                node = parent  # the value is one of the operands
            elif isinstance(parent, (nodes.If, nodes.CondExpr, nodes.Not)):
                return  # truthiness: every text spliced is non-empty
            elif isinstance(parent, nodes.Test) and parent.node is node and parent.name in SAFE_TESTS:
                return
            elif isinstance(parent, nodes.Assign) and parent.node is node and isinstance(parent.target, nodes.Name):
                name = parent.target.name
                self.names[name] = self.names.get(name, False) or derived
                return
            elif isinstance(parent, nodes.Filter) and parent.node is node and parent.name == "trim" and not parent.args:
                node = parent  # changes no spliced text: none has whitespace at either end
            elif isinstance(parent, nodes.Compare) and not derived:
                self._compare(node, parent)
                return
            elif isinstance(parent, nodes.Getattr) and parent.node is node:
                node = self._method(parent, derived)
                if node is None:
                    return
            else:
                raise _Refused(f"content used in {type(parent).__name__}")

    def _compare(self, node: Any, compare: Any) -> None:
        from jinja2 import nodes

        if len(compare.ops) != 1:
            raise _Refused("chained comparison")
        op = compare.ops[0]
        other = op.expr if compare.expr is node else compare.expr
        if not (isinstance(other, nodes.Const) and isinstance(other.value, str)):
            raise _Refused("content compared with a non-constant")
        if op.op in ("eq", "ne"):
            self.constants.add(other.value)
        elif op.op in ("in", "notin") and op.expr is node:
            self.substrings.add(other.value)
        else:
            raise _Refused(f"content compared with {op.op}")

    def _method(self, attr: nodes.Getattr, derived: bool) -> Any:
        """A method called on a content: the node whose value is the content again, or None if used up."""
        from jinja2 import nodes

        call = self.parents.get(id(attr))
        if not (isinstance(call, nodes.Call) and call.node is attr and not call.kwargs
                and call.dyn_args is None and call.dyn_kwargs is None):
            raise _Refused(f"content attribute {attr.attr}")
        if not all(isinstance(a, nodes.Const) and isinstance(a.value, str) for a in call.args):
            raise _Refused(f"{attr.attr} with a non-constant argument")
        args = [a.value for a in call.args if isinstance(a, nodes.Const)]
        if attr.attr in STRIP_METHODS and all(a.isspace() for a in args) and len(args) <= 1:
            return call  # changes no spliced text: none has whitespace at either end
        if derived:
            raise _Refused(f"{attr.attr} of a concatenation")
        if attr.attr in TEST_METHODS and len(args) == 1:
            self.substrings.add(args[0])
            return None
        if attr.attr == "split" and len(args) == 1 and args[0]:
            index = self.parents.get(id(call))
            if (isinstance(index, nodes.Getitem) and index.node is call and isinstance(index.arg, (nodes.Const, nodes.Neg))
                    and _int_value(index.arg) in (0, -1)):
                self.substrings.add(args[0])
                return index  # identity when the separator is absent
        raise _Refused(f"content method {attr.attr}")


def _int_value(node: Any) -> int | None:
    from jinja2 import nodes

    if isinstance(node, nodes.Neg) and isinstance(node.node, nodes.Const) and isinstance(node.node.value, int):
        return -node.node.value
    return node.value if isinstance(node, nodes.Const) and isinstance(node.value, int) else None


class ChatSplicer:
    """Renders one-turn conversations by splicing, where that is proven to equal `render`."""

    def __init__(self, template: str | None, render: Callable[[list[dict[str, Any]], bool | None], str]):
        self.uses = content_uses(template) if template else None
        self._render = render
        self._parts: dict[tuple[str | None, bool | None], tuple[str, str] | None] = {}

    def render(self, messages: list[dict[str, Any]], thinking: bool | None) -> str | None:
        """The rendered prompt, or None when jinja must render this conversation."""
        if self.uses is None or not 1 <= len(messages) <= 2:
            return None
        user = messages[-1]
        system = messages[0]["content"] if len(messages) == 2 else None
        if user["role"] != "user" or (system is not None and messages[0]["role"] != "system"):
            return None
        text = user["content"]
        if not self.plain(text):
            return None
        key = (system, thinking)
        if key not in self._parts:
            if len(self._parts) >= MAX_KEYS:
                return None
            self._parts[key] = self._learn(system, thinking)
        parts = self._parts[key]
        return None if parts is None else parts[0] + text + parts[1]

    def plain(self, text: str) -> bool:
        """A text the template treats like the placeholder: no edge whitespace, no trigger."""
        uses = self.uses
        return (uses is not None and bool(text) and not text[0].isspace() and not text[-1].isspace()
                and text not in uses.constants and not any(s in text for s in uses.substrings))

    def _learn(self, system: str | None, thinking: bool | None) -> tuple[str, str] | None:
        """(prefix, suffix) around the placeholder, if the splice equals the real render on every probe."""
        assert self.uses is not None
        head = [] if system is None else [{"role": "system", "content": system}]
        try:
            rendered = self._render([*head, {"role": "user", "content": PLACEHOLDER}], thinking)
        except Exception:  # the template refuses this conversation: jinja will say why, row by row
            return None
        if rendered.count(PLACEHOLDER) != 1:
            return None
        prefix, suffix = rendered.split(PLACEHOLDER)
        probes = [*PROBES, *(t for c in sorted(self.uses.literals) for t in (c, f"x{c}x", f"{c}\n{c}"))]
        for probe in filter(self.plain, probes):
            try:
                if self._render([*head, {"role": "user", "content": probe}], thinking) != prefix + probe + suffix:
                    return None
            except Exception:
                return None
        return prefix, suffix
