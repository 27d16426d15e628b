"""Text <-> token ids from the tokenizer a `.colibri` file embeds (`metadata["tokenizer"]`).

Uses the `tokenizers` library on the embedded `tokenizer_json`. Stop tokens come from
`generation_config["eos_token_id"]`, else the tokenizer's eos token.

Chat formatting renders the embedded `tokenizer_config["chat_template"]`: code written by whoever made the file.
It runs in jinja2's ImmutableSandboxedEnvironment (no attribute escapes, no changes to lists and dicts) under
`TemplateLimits`: a wall clock, a count of loop iterations (all loops together, nested or recursive), a count of
calls (functions, methods, macros, filters), and a size bound on the output and on every value built on the way
(`*`, `+`, `%`, `~`, literals, `join`, `format`, `center`, `replace`, ... are sized before they run). Anything
refused or broken is one `ChatTemplateError` naming `tokenizer.chat_template`. jinja2 is imported only when a chat
prompt is built.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import re
import string
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from colibri_format.errors import ColibriFormatError, InvalidInput, InvalidMetadata

CHAT_TEMPLATE_FIELD = "tokenizer.chat_template"
MIN_JINJA2 = (3, 1, 6)       # str.format sandboxed where it is looked up, |attr included (CVE-2024-56326, CVE-2025-27516)
JINJA2_INSTALL = "pip install 'jinja2>=3.1.6'"


class ChatTemplateError(InvalidMetadata):
    """The file's chat template was refused (by the sandbox or a `TemplateLimits` bound) or failed to render."""


@dataclass(frozen=True)
class TemplateLimits:
    """Bounds on rendering one chat template. Sizes count characters (a container: its items' sizes plus two per
    item), and the size bounds grow by twice the text in the messages, so a long prompt is never refused for its
    own length."""

    seconds: float = 5.0                  # wall clock: parsing, compiling and rendering
    loop_iterations: int = 1_000_000      # all loops together
    calls: int = 1_000_000                # function, method, macro and filter calls together
    output_chars: int = 1 << 20           # the rendered text, and any one value built on the way
    built_chars: int = 16 << 20           # every value built, together (strings, lists, formatted output)
    template_chars: int = 256 << 10       # the template's source


def _token_text(token: Any) -> str | None:
    """Special tokens appear as plain strings or as serialized AddedToken dicts ({"content": ...})."""
    return token.get("content") if isinstance(token, dict) else token


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


class Tokenizer:
    def __init__(self, tokenizer_json: str, tokenizer_config: dict | None = None,
                 generation_config: dict | None = None) -> None:
        from tokenizers import Tokenizer as _HFTokenizer  # optional at import time of the runtime

        try:
            self._tok = _HFTokenizer.from_str(tokenizer_json)
        except Exception as exc:  # the tokenizers library raises a bare Exception on bad JSON
            raise InvalidMetadata(f"embedded tokenizer_json does not load: {exc}", field="tokenizer") from None
        self.config = tokenizer_config or {}
        self.generation_config = generation_config or {}

    @classmethod
    def from_metadata(cls, metadata: dict) -> "Tokenizer | None":
        entry = (metadata or {}).get("tokenizer")
        if not entry or not entry.get("tokenizer_json"):
            return None
        return cls(entry["tokenizer_json"], entry.get("tokenizer_config"), entry.get("generation_config"))

    @property
    def library_tokenizer(self):
        """The `tokenizers` library's object (vocabulary, model, normalizer: what size bounds are computed from)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def special_token(self, name: str) -> str | None:
        return _token_text(self.config.get(name))

    @property
    def stop_ids(self) -> list[int]:
        ids = _as_list(self.generation_config.get("eos_token_id"))
        if ids:
            return ids
        eos = self.special_token("eos_token")
        token_id = self._tok.token_to_id(eos) if eos else None
        return [token_id] if token_id is not None else []

    @property
    def chat_template(self) -> str | None:
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            limits: TemplateLimits | None = None) -> str:
        """The prompt text of `messages`, rendered by the file's chat template under `limits`.

        Raises:
            ChatTemplateError: the template is refused (sandbox, time, loops, calls, sizes) or broken.
            InvalidInput: the file has no chat template, jinja2 is not installed, or the template called
                raise_exception on these messages.
        """
        template = self.chat_template
        if not template:
            raise InvalidInput("this file's tokenizer has no chat template", field=CHAT_TEMPLATE_FIELD)
        if not isinstance(template, str):
            raise ChatTemplateError("the chat template is not a string", field=CHAT_TEMPLATE_FIELD,
                                    value=type(template).__name__)
        return render_chat_template(template, limits or TemplateLimits(), messages=messages,
                                    add_generation_prompt=add_generation_prompt,
                                    bos_token=self.special_token("bos_token") or "",
                                    eos_token=self.special_token("eos_token") or "")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # The template already writes every special token (bos included), so none are added again.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


# --- rendering an untrusted template ----------------------------------------------------------------------------
def render_chat_template(template: str, limits: TemplateLimits, **context: Any) -> str:
    """Render `template` with `context` in the bounded sandbox.

    Raises:
        ChatTemplateError: refused by the sandbox or a bound, or the template does not parse or fails.
        InvalidInput: jinja2 is missing or too old, or the template called raise_exception.
    """
    if len(template) > limits.template_chars:
        raise ChatTemplateError(f"chat template is {len(template):,} characters (limit {limits.template_chars:,})",
                                field=CHAT_TEMPLATE_FIELD)
    _require_jinja2()
    env_class, guard = _jinja()
    budget = _Budget(limits, 2 * _size(context, float("inf")))
    try:
        env = env_class(budget)
        tmpl = env.from_string(guard().visit(env.parse(template)))
        out = []
        for piece in tmpl.generate(**context):
            budget.emit(piece)
            out.append(piece)
        return "".join(out)
    except ColibriFormatError:
        raise                                   # raise_exception(...) from the template: the messages are refused
    except _Refused as exc:
        raise ChatTemplateError(f"chat template refused: {exc}", field=CHAT_TEMPLATE_FIELD) from None
    except RecursionError:
        raise ChatTemplateError("chat template refused: it recursed too deeply", field=CHAT_TEMPLATE_FIELD) from None
    except MemoryError:
        raise ChatTemplateError("chat template refused: it ran out of memory", field=CHAT_TEMPLATE_FIELD) from None
    except Exception as exc:  # noqa: BLE001 - sandbox refusals, syntax errors, any error of the template's own code
        raise ChatTemplateError(_failure(exc), field=CHAT_TEMPLATE_FIELD) from None


def _failure(exc: Exception) -> str:
    from jinja2.exceptions import SecurityError, TemplateSyntaxError

    text = " ".join(str(exc).split())
    text = text if len(text) <= 200 else text[:197] + "..."
    if isinstance(exc, SecurityError):
        return f"chat template refused by the sandbox: {text}"
    if isinstance(exc, TemplateSyntaxError):
        return f"chat template does not parse: {text} (line {exc.lineno})"
    if isinstance(exc, OverflowError):
        return f"chat template refused: {text}"
    return f"chat template failed: {type(exc).__name__}: {text}"


class _Refused(BaseException):
    """A bound was hit. A BaseException, so that no `except Exception` inside jinja2 or a filter swallows it."""


def _size(value: Any, limit: float) -> int:
    """About len(str(value)): characters of strings, digits of integers, containers counted item by item
    (two per item besides); stops early once past `limit`, so it costs at most O(limit)."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, (str, bytes, bytearray)):
            total += len(v)
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 1
        elif isinstance(v, (list, tuple, set, frozenset, range)):
            total += 2 + 2 * len(v)
            if total <= limit and not isinstance(v, range):
                stack.extend(v)
        elif isinstance(v, dict):
            total += 2 + 4 * len(v)
            if total <= limit:
                stack.extend(v.keys())
                stack.extend(v.values())
        elif type(v).__name__ == "Namespace":        # jinja2.utils.Namespace: its attributes are in its repr
            stack.append(v._Namespace__attrs)
        else:
            total += 32                                # numbers, None, undefined, macros, generators
    return total


class _Budget:
    """What one rendering may still spend: time, loop iterations, calls, characters."""

    def __init__(self, limits: TemplateLimits, extra_chars: int) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds
        self.iterations = self.calls = self.output = 0
        self.max_chars = limits.output_chars + extra_chars
        self.built_left = limits.built_chars + 8 * extra_chars

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _Refused(f"it ran longer than {self.limits.seconds:g} s")

    def call(self) -> None:
        self.calls += 1
        if self.calls > self.limits.calls:
            raise _Refused(f"it made more than {self.limits.calls:,} calls")
        self.tick()

    def loop(self, iterable: Any):
        """`iterable`, counting each step against the loop bound (shared by every loop)."""
        for item in iterable:
            self.iterations += 1
            if self.iterations > self.limits.loop_iterations:
                raise _Refused(f"its loops ran more than {self.limits.loop_iterations:,} iterations")
            self.tick()
            yield item

    def fits(self, size: int, what: str) -> None:
        if size > self.max_chars:
            raise _Refused(f"{what} would be {size:,} characters (limit {self.max_chars:,})")

    def built(self, value: Any, what: str = "a value") -> Any:
        """`value` after checking its size and charging it to the characters built."""
        size = _size(value, self.max_chars)
        self.fits(size, what)
        self.built_left -= size
        if self.built_left < 0:
            raise _Refused(f"it built more than {self.limits.built_chars:,} characters of values")
        return value

    def emit(self, piece: str) -> None:
        self.output += len(piece)
        self.fits(self.output, "the output")

    def join(self, pieces: Any) -> str:
        """environment.concat: the output of a macro, a call block, a {% set %} block or a {% filter %} block."""
        parts, size = [], 0
        for piece in pieces:
            size += len(piece)
            self.fits(size, "a block's output")
            parts.append(piece)
        return self.built("".join(parts), "a block's output")


# --- sizes of operations, before they run ---------------------------------------------------------------------
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _ints(*values: Any) -> list[int]:
    found = []
    for v in values:
        items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]
        found += [abs(i) for i in items if isinstance(i, int)]
    return found


def _percent_size(fmt: str | bytes, args: Any, limit: int) -> int:
    """Size of `fmt % args`: the text, the widths and precisions, and every field as large as all the args."""
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    specs = _PERCENT_SPEC.findall(text)
    numbers = [int(n) for spec in specs for n in spec if n.isdigit()]
    if any("*" in spec for spec in specs):
        numbers += _ints(args)
    return len(text) + sum(numbers) + len(specs) * _size(args, limit)


def _format_size(fmt: str, args: tuple, kwargs: dict, limit: int) -> int:
    """Size of `fmt.format(*args, **kwargs)`: the text, and per field the widest spec plus all the args."""
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return len(fmt)                                 # the call itself raises
    arg_size = _size((args, kwargs), limit)
    total = 0
    for literal, name, spec, _ in fields:
        total += len(literal)
        if name is None:
            continue
        numbers = [int(n) for n in re.findall(r"\d+", spec or "")]
        if spec and "{" in spec:
            numbers += _ints(args, kwargs)
        total += max(numbers, default=0) + arg_size
    return total


def _binop_size(op: str, left: Any, right: Any, limit: int) -> int:
    sequences = (str, bytes, list, tuple)
    if op == "*":
        if isinstance(left, int) and isinstance(right, sequences):
            left, right = right, left
        if isinstance(left, sequences) and isinstance(right, int):
            return _size(left, limit) * max(right, 0)
        if isinstance(left, int) and isinstance(right, int):
            return (left.bit_length() + right.bit_length()) // 3
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        return left.bit_length() * right // 3
    elif op == "+" and isinstance(left, sequences) and isinstance(right, sequences):
        return _size(left, limit) + _size(right, limit)
    elif op == "%" and isinstance(left, (str, bytes)):
        return _percent_size(left, right, limit)
    return 0


def _method_size(target: Any, name: str, args: tuple, kwargs: dict, limit: int) -> int:
    """Size of the result of the str/bytes/int method `target.name(*args, **kwargs)`, for those that can grow."""
    def arg(i: int, key: str, default: Any) -> Any:
        return args[i] if len(args) > i else kwargs.get(key, default)

    if isinstance(target, int) and name == "to_bytes":
        return int(arg(0, "length", 1))
    if not isinstance(target, (str, bytes)):
        return 0
    n = len(target)
    if name in ("center", "ljust", "rjust", "zfill") and isinstance(arg(0, "width", 0), int):
        return max(n, arg(0, "width", 0))
    if name == "expandtabs" and isinstance(arg(0, "tabsize", 8), int):
        return n + target.count("\t" if isinstance(target, str) else b"\t") * max(arg(0, "tabsize", 8), 0)
    if name == "replace" and len(args) >= 2 and isinstance(args[0], type(target)) and isinstance(args[1], type(target)):
        old, new, count = args[0], args[1], arg(2, "count", -1)
        hits = target.count(old) if old else n + 1
        hits = min(hits, count) if isinstance(count, int) and count >= 0 else hits
        return n + hits * max(0, len(new) - len(old))
    if name == "translate" and isinstance(target, str) and args:
        table = args[0]
        values = table.values() if isinstance(table, dict) else table if isinstance(table, (list, tuple)) else ()
        return n * max([len(v) for v in values if isinstance(v, str)] + [1])
    if name in ("format", "format_map") and isinstance(target, str):
        if name == "format_map":
            args, kwargs = (), (args[0] if args and isinstance(args[0], dict) else {})
        return _format_size(target, args, kwargs, limit)
    return 0


def _filter_size(name: str, bound: inspect.BoundArguments, limit: int) -> int:
    """Size of the result of the builtin filter `name` (0: sized afterwards, by what it returns)."""
    a = bound.arguments
    first = next(iter(a.values()))
    if name == "center":
        return max(_size(first, limit), a.get("width", 80))
    if name == "indent":
        width, lines = a.get("width", 4), first.count("\n") + 1 if isinstance(first, str) else 1
        pad = width if isinstance(width, int) else len(str(width))
        return _size(first, limit) + lines * max(pad, 0)
    if name == "format":
        return _percent_size(str(first), a.get("args") or a.get("kwargs") or (), limit)
    if name == "replace" and isinstance(a.get("s"), str):
        return _method_size(a["s"], "replace", (str(a["old"]), str(a["new"]), a.get("count") or -1), {}, limit)
    if name == "wordwrap":
        wrap = a.get("wrapstring") or "\n"
        return _size(first, limit) * (1 + len(str(wrap))) + len(str(wrap))
    if name == "tojson":
        return _size(first, limit) * (1 + max(a.get("indent") or 0, 0))
    if name in ("batch", "slice"):
        count = a.get("linecount", a.get("slices", 0))
        return _size(first, limit) + max(count, 0) * (2 + _size(a.get("fill_with"), limit))
    if name == "round" and isinstance(a.get("precision"), int):
        return abs(a["precision"])                      # digits of 10**precision
    if name == "join" and isinstance(first, (list, tuple)):
        return _size(first, limit) + len(str(a.get("d", ""))) * len(first)
    if name == "sum" and isinstance(first, (list, tuple)) and not isinstance(a.get("start", 0), (int, float)):
        return _size(first, limit) * len(first)         # adding sequences copies the growing total each time
    if name in ("string", "pprint", "urlize", "xmlattr", "urlencode", "escape", "e", "forceescape"):
        return _size(first, limit)                      # the str() of a container
    return 0


# --- the environment --------------------------------------------------------------------------------------------
def _require_jinja2() -> None:
    """jinja2 is an install-time dependency, but a trimmed environment may lack it (or hold an old one)."""
    try:
        import jinja2
    except ImportError:
        raise InvalidInput(f"chat formatting needs jinja2: {JINJA2_INSTALL}", field="chat") from None
    found = getattr(jinja2, "__version__", None) or importlib.metadata.version("jinja2")
    if tuple(int(p) for p in re.findall(r"\d+", found)[:3]) < MIN_JINJA2:
        raise InvalidInput(f"chat formatting needs jinja2>=3.1.6 (found {found}): {JINJA2_INSTALL}", field="chat")


@functools.lru_cache(maxsize=None)
def _jinja():
    """The bounded environment class and the AST guard, built once on first use."""
    from jinja2 import nodes
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    def env_call(attribute: str, args: list, lineno: int):
        return nodes.Call(nodes.EnvironmentAttribute(attribute), args, [], None, None, lineno=lineno)

    class Guard(NodeTransformer):
        """Rewrites the parsed template: every loop iterates through the budget, every `~` and every list,
        tuple and dict literal is sized."""

        def visit_For(self, node):
            self.generic_visit(node)
            node.iter = env_call("colibri_loop", [node.iter], node.lineno)
            return node

        def visit_Concat(self, node):
            self.generic_visit(node)
            return env_call("colibri_concat", node.nodes, node.lineno)

        def _literal(self, node):
            self.generic_visit(node)
            if getattr(node, "ctx", "load") != "load":
                return node                          # an assignment target: {% set a, b = ... %}
            return env_call("colibri_built", [node], node.lineno)

        visit_List = visit_Tuple = visit_Dict = _literal

    signatures: dict = {}

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def __init__(self, budget: _Budget) -> None:
            super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                             finalize=self._finalize)
            self.budget = budget
            self.concat = budget.join
            self.colibri_loop = budget.loop
            self.colibri_built = budget.built
            self.filters = {name: self._guard_filter(name, f) for name, f in self.filters.items()}
            self.globals.pop("lipsum", None)        # lipsum(n=10**9) is one uninterruptible call
            self.globals["raise_exception"] = _raise_exception
            self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)

        def colibri_concat(self, *parts: Any) -> str:
            self.budget.fits(sum(_size(p, self.budget.max_chars) for p in parts), "a `~` concatenation")
            return self.budget.built("".join(map(str, parts)), "a `~` concatenation")

        def _finalize(self, value: Any) -> Any:
            return self.budget.built(value, "an output value")

        def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
            self.budget.tick()
            self.budget.fits(_binop_size(operator, left, right, self.budget.max_chars), f"a `{operator}` result")
            return self.budget.built(super().call_binop(context, operator, left, right), f"a `{operator}` result")

        def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja2's own spelling)
            budget = __self.budget
            budget.call()
            if isinstance(__obj, LoopContext) and args:            # loop(children) in a recursive loop
                args = (budget.loop(args[0]), *args[1:])
            method = getattr(__obj, "__wrapped__", __obj)           # str.format comes wrapped by the sandbox
            target, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
            if name == "join" and isinstance(target, (str, bytes)) and len(args) == 1:
                args = (list(args[0]),)
                budget.fits(_size(args[0], budget.max_chars) + len(target) * len(args[0]), "a join")
            what = f"the result of {name}()" if name else "a call's result"
            budget.fits(_method_size(target, name, args, kwargs, budget.max_chars), what)
            return budget.built(super().call(__context, __obj, *args, **kwargs), what)

        def _guard_filter(self, name: str, func: Any) -> Any:
            inner = inspect.unwrap(func)                 # async_variant wrappers take (*args, **kwargs)
            if inner not in signatures:
                signatures[inner] = inspect.signature(inner)
            signature = signatures[inner]
            skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0
            inner_skip = 1 if getattr(inner, "jinja_pass_arg", None) is not None else 0

            @functools.wraps(func)
            def guarded(*args: Any, **kwargs: Any) -> Any:
                budget = self.budget
                budget.call()
                if name in ("join", "sum") and len(args) > skip and not isinstance(args[skip], (str, list, tuple)):
                    args = (*args[:skip], list(args[skip]), *args[skip + 1:])   # a generator: items are sized
                try:
                    bound = signature.bind(*args[skip - inner_skip:], **kwargs)
                except TypeError:
                    return func(*args, **kwargs)                 # raises the filter's own TypeError
                bound.apply_defaults()
                if inner_skip:
                    del bound.arguments[next(iter(bound.arguments))]    # the context or environment jinja2 passes
                budget.fits(_filter_size(name, bound, budget.max_chars), f"the result of |{name}")
                result = func(*args, **kwargs)
                return budget.built(result, f"the result of |{name}")
            return guarded

    return BoundedEnvironment, Guard


def _raise_exception(message: str) -> None:
    raise InvalidInput(f"chat template refused the messages: {message}", field="messages")
