"""Request bodies of the OpenAI API (and ember's extensions), as strict pydantic models.

An unknown field is refused with a 400 that names it: nothing a request asks for is silently
ignored. Fields OpenAI defines but ember does not serve yet are accepted only at their
do-nothing values and refused otherwise, with a message that says so.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from ember.errors import InvalidRequest
from ember.constraint import Constraint
from ember.request import MAX_INT32, MAX_LOGPROBS, SEED_RANGE, RequestOptions, SamplingParams

# Bounds on what one request may ask for (the README's "Limits and errors" table lists them).
# Each is checked here, before the engine sees the request, with a message naming the range.
DEFAULT_MAX_N = 16
MAX_LOGIT_BIAS = 1024          # entries
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_STOP = 16                  # stop strings
MAX_STOP_CHARS = 256           # characters in one stop string
MAX_STOP_TOKEN_IDS = 256
MAX_MESSAGES = 2048
MAX_TOOLS = 128
MAX_TOOLS_BYTES = 256 << 10    # the tools list, serialized as JSON
MAX_CONSTRAINT_BYTES = 64 << 10  # a schema, regex, grammar or choice list, serialized
MAX_CONSTRAINT_DEPTH = 64      # nesting of a schema's JSON, or of a regex's or grammar's brackets
MAX_CHOICES = 1024
# (name, lowest, highest, lowest included): OpenAI's ranges, and vLLM's for its extensions
FLOAT_RANGES = (("temperature", 0.0, 2.0, True), ("top_p", 0.0, 1.0, False),
                ("min_p", 0.0, 1.0, True), ("presence_penalty", -2.0, 2.0, True),
                ("frequency_penalty", -2.0, 2.0, True), ("repetition_penalty", 0.0, 10.0, False))


class Strict(BaseModel):
    """Unknown fields are refused; a null field means "use the default". Floats must be
    finite: Python's json reads NaN and Infinity, which no sampling parameter can take."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(Strict):
    include_usage: bool = False


MAX_TRANSFER_BLOCKS = 1 << 16   # blocks one transfer may name (a 1M-token prompt of 16s)
MAX_URL_CHARS = 2048
MAX_ID_CHARS = 256


class KVFormatFields(Strict):
    model: str = Field(max_length=MAX_ID_CHARS)
    dtype: str = Field(max_length=32)
    block_size: int = Field(ge=1, le=MAX_INT32)
    num_layers: int = Field(ge=1, le=MAX_INT32)
    num_kv_heads: int = Field(ge=1, le=MAX_INT32)
    head_dim: int = Field(ge=1, le=MAX_INT32)


class KVTransferParams(Strict):
    """Disaggregated serving (vLLM's field): `{"do_remote_decode": true}` asks a prefill
    replica to compute the prompt and its first token and keep the KV for a decode
    replica; the transfer parameters it answers with, sent on to a decode replica
    unchanged, make that one pull the KV and go on (ember/kv_transfer/params.py)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    transfer_id: str | None = Field(None, pattern=r"^[0-9a-f]{1,64}$")
    remote_url: str | None = Field(None, max_length=MAX_URL_CHARS)
    remote_replica_id: str | None = Field(None, max_length=MAX_ID_CHARS)
    remote_block_ids: list[int] | None = Field(None, max_length=MAX_TRANSFER_BLOCKS)
    block_keys: list[int] | None = Field(None, max_length=MAX_TRANSFER_BLOCKS)
    num_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    first_token_id: int | None = Field(None, ge=0, le=MAX_INT32)
    num_cached_tokens: int | None = Field(None, ge=0, le=MAX_INT32)
    expires_at: float | None = None
    kv_format: KVFormatFields | None = None

    def check(self) -> None:
        if self.do_remote_decode == self.do_remote_prefill:
            raise InvalidRequest("kv_transfer_params takes one of do_remote_decode (to a "
                                 "prefill replica) and do_remote_prefill (to a decode replica, "
                                 "with the prefill replica's answer)",
                                 param="kv_transfer_params")
        if self.do_remote_decode:
            return
        missing = [name for name in ("transfer_id", "remote_url", "remote_replica_id",
                                     "remote_block_ids", "block_keys", "num_tokens",
                                     "first_token_id", "num_cached_tokens", "expires_at",
                                     "kv_format") if getattr(self, name) is None]
        if missing:
            raise InvalidRequest(f"kv_transfer_params with do_remote_prefill lacks "
                                 f"{', '.join(missing)}; send the prefill replica's "
                                 "kv_transfer_params unchanged", param="kv_transfer_params")
        if not self.remote_url.startswith(("http://", "https://")):
            raise InvalidRequest("kv_transfer_params.remote_url must be an http(s) URL",
                                 param="kv_transfer_params.remote_url")
        if not all(0 <= b <= MAX_INT32 for b in self.remote_block_ids) or \
                not all(0 <= k < 2**64 for k in self.block_keys):
            raise InvalidRequest("kv_transfer_params: block ids must be in [0, 2**31) and "
                                 "block keys in [0, 2**64)", param="kv_transfer_params")


class SamplingFields(Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # ember (and vLLM) extensions
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0                # lower runs first
    cache_salt: str | None = None    # share cached prefixes only with the same salt
    prefix_cache: bool = True        # False: neither reuse nor store cached KV
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # json, regex, choice, grammar, lark,
                                                      # json_object (vLLM-style extension)
    kv_transfer_params: KVTransferParams | None = None   # disaggregated serving

    def check_limits(self, max_n: int) -> None:
        """Every bound a sampling field has, each with a message that names its range."""
        _in_range("n", self.n, 1, max_n, " (the server's --max-n)")
        _in_range("seed", self.seed, *SEED_RANGE)
        _in_range("min_tokens", self.min_tokens, 0, MAX_INT32)
        if self.top_k != -1:
            _in_range("top_k", self.top_k, 0, MAX_INT32, "; 0 or -1 turn it off")
        _in_range("priority", self.priority, -MAX_INT32 - 1, MAX_INT32, "; lower runs first")
        for name, low, high, closed in FLOAT_RANGES:
            value = getattr(self, name)
            if not (low <= value if closed else low < value) or value > high:
                raise InvalidRequest(f"{name}={value} must be in {'[' if closed else '('}"
                                     f"{low:g}, {high:g}]", param=name)
        self._check_stop()
        self._check_logit_bias()
        if self.kv_transfer_params is not None:
            self.kv_transfer_params.check()

    def check_transfer(self, constrained: bool) -> None:
        """What a disaggregated request cannot ask for (yet): each a clear 400."""
        params = self.kv_transfer_params
        if params is None:
            return
        refused = [what for what, asked in (
            ("n > 1", self.n != 1), ("stream on a prefill replica (its answer is one JSON "
                                     "body)", params.do_remote_decode and self.stream),
            ("structured output or tools", constrained)) if asked]
        if refused:
            raise InvalidRequest(f"kv_transfer_params cannot be combined with "
                                 f"{'; '.join(refused)}; send the request to one replica "
                                 "without kv_transfer_params", param="kv_transfer_params")

    def _check_stop(self) -> None:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP:
            raise InvalidRequest(f"stop has {len(stop)} strings; send at most {MAX_STOP}",
                                 param="stop")
        if not all(0 < len(s) <= MAX_STOP_CHARS for s in stop):
            raise InvalidRequest(f"each stop string must have 1 to {MAX_STOP_CHARS} characters",
                                 param="stop")
        ids = self.stop_token_ids or []
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"stop_token_ids has {len(ids)} ids; send at most "
                                 f"{MAX_STOP_TOKEN_IDS}", param="stop_token_ids")
        if not all(0 <= t <= MAX_INT32 for t in ids):
            raise InvalidRequest("stop_token_ids must be token ids in the vocabulary (at least "
                                 "0; see /tokenize)", param="stop_token_ids")

    def _check_logit_bias(self) -> None:
        bias = self._bias() or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias has {len(bias)} entries; send at most "
                                 f"{MAX_LOGIT_BIAS}", param="logit_bias")
        low, high = LOGIT_BIAS_RANGE
        for token_id, value in bias.items():
            if not 0 <= token_id <= MAX_INT32:
                raise InvalidRequest(f"logit_bias key {token_id} is not a token id; keys are "
                                     "token ids in the vocabulary (see /tokenize)",
                                     param="logit_bias")
            if not low <= value <= high:
                raise InvalidRequest(f"logit_bias value {value} for token {token_id} must be in "
                                     f"[{low:g}, {high:g}]", param="logit_bias")

    def _check_max_tokens(self, name: str, value: int | None) -> None:
        """`value` is the max_tokens that applies; min_tokens may not exceed it."""
        _in_range(name, value, 1, MAX_INT32, "; a value past the context is cut to the room "
                  "left")
        if value is not None and self.min_tokens > value:
            raise InvalidRequest(f"min_tokens={self.min_tokens} must be in [0, {name}={value}]",
                                 param="min_tokens")

    def constraint(self) -> Constraint | None:
        """response_format or structured_outputs (not both) -> a Constraint."""
        if self.response_format and self.structured_outputs:
            raise InvalidRequest("send response_format or structured_outputs, not both",
                                 param="structured_outputs")
        if self.response_format:
            return _response_format(self.response_format)
        if self.structured_outputs:
            return _structured_outputs(self.structured_outputs)
        return None

    def request_options(self) -> RequestOptions:
        return RequestOptions(priority=self.priority, user=self.user,
                              cache_salt=self.cache_salt, prefix_cache=self.prefix_cache)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:  # (int() refuses a string of over 4300 digits with a ValueError too)
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise InvalidRequest("logit_bias keys must be token ids (strings of integers)",
                                 param="logit_bias") from None

    def sampling_params(self, max_tokens: int | None, num_logprobs: int | None,
                        constraint: Constraint | None = None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed with stream=true",
                                 param="stream_options")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self._bias(),
            stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, logprobs=num_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, constraint=constraint)


def _in_range(name: str, value: int | None, low: int, high: int, note: str = "") -> None:
    if value is not None and not low <= value <= high:
        raise InvalidRequest(f"{name}={_short(value)} must be an integer in [{low}, {high}]"
                             f"{note}", param=name)


def _short(value: int) -> str:
    """An integer for a message: a huge one would make the message huge."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} digits)"


def _check_constraint_size(what: str, spec: Any, param: str) -> None:
    """A schema, regex, grammar or choice list small and shallow enough to compile: the
    grammar engine's parsers recurse, and its compile time grows with the size."""
    text = spec if isinstance(spec, str) else json.dumps(spec)
    if len(text.encode("utf-8", "surrogatepass")) > MAX_CONSTRAINT_BYTES:
        raise InvalidRequest(f"the {what} is over {MAX_CONSTRAINT_BYTES} bytes; simplify it",
                             param=param)
    depth = bracket_depth(text)
    if depth > MAX_CONSTRAINT_DEPTH:
        raise InvalidRequest(f"the {what} nests {depth} levels deep; at most "
                             f"{MAX_CONSTRAINT_DEPTH} are allowed, so simplify it", param=param)


def bracket_depth(text: str) -> int:
    """The deepest nesting of (), [] and {} in `text`, not counting backslash-escaped ones.
    It over-counts brackets inside quotes or character classes, which only errs on the safe
    side."""
    depth = deepest = 0
    escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in ")]}":
            depth = max(depth - 1, 0)
    return deepest


def _load_schema(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise InvalidRequest(f"the JSON schema nests deeper than {MAX_CONSTRAINT_DEPTH} levels",
                             param=param) from None
    except ValueError as e:
        raise InvalidRequest(f"the JSON schema is not valid JSON ({e})", param=param) from None


def _response_format(fmt: dict[str, Any]) -> Constraint | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise InvalidRequest("response_format json_schema needs {'name': ..., 'schema': "
                                 "{...}}", param="response_format.json_schema")
        _check_constraint_size("JSON schema", spec["schema"], "response_format.json_schema")
        return Constraint.json_schema(spec["schema"])
    raise InvalidRequest(f"response_format type {kind!r} is not one of text, json_object, "
                         "json_schema", param="response_format.type")


def _structured_outputs(spec: dict[str, Any]) -> Constraint:
    given = [k for k in ("json", "regex", "choice", "grammar", "lark", "json_object")
             if spec.get(k) not in (None, False)]
    unknown = sorted(set(spec) - {"json", "regex", "choice", "grammar", "lark", "json_object"})
    if unknown or len(given) != 1:
        raise InvalidRequest("structured_outputs takes exactly one of json, regex, choice, "
                             "grammar, lark, json_object" + (f"; unknown: {', '.join(unknown)}"
                                                             if unknown else ""),
                             param="structured_outputs")
    kind = given[0]
    param = f"structured_outputs.{kind}"
    if kind != "json_object":
        _check_constraint_size(kind, spec[kind], param)
    if kind == "json":
        schema = spec["json"]
        return Constraint.json_schema(_load_schema(schema, param) if isinstance(schema, str)
                                      else schema)
    if kind == "choice":
        if isinstance(spec["choice"], list) and len(spec["choice"]) > MAX_CHOICES:
            raise InvalidRequest(f"choice has {len(spec['choice'])} entries; send at most "
                                 f"{MAX_CHOICES}", param=param)
        return Constraint.choice(spec["choice"])
    if kind == "json_object":
        return Constraint("json_object")
    if not isinstance(spec[kind], str) or not spec[kind]:
        raise InvalidRequest(f"structured_outputs.{kind} must be a non-empty string",
                             param=f"structured_outputs.{kind}")
    return Constraint(kind, spec[kind])


class CompletionRequest(SamplingFields):
    prompt: Any  # checked by prompt_list(): pydantic's union errors would be unreadable
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompt_list(self) -> list[str | list[int]]:
        """A string, strings, token ids, or lists of token ids -> one entry per prompt."""
        p = self.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and _is_ids(p)):
            p = [p]
        if not isinstance(p, list) or not p or not all(
                isinstance(x, str) for x in p) and not all(_is_ids(x) for x in p):
            raise InvalidRequest("prompt must be a string, a list of strings, a list of token "
                                 "ids, or a list of lists of token ids (not empty)",
                                 param="prompt")
        return p

    def check_limits(self, max_n: int) -> None:
        super().check_limits(max_n)
        self._check_max_tokens("max_tokens", self.max_tokens)
        _in_range("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        _in_range("best_of", self.best_of, 1, max_n, " (the server's --max-n)")

    def check_supported(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("best_of other than n is not supported by ember; drop it, "
                                 "or ask for n completions", param="best_of")
        if self.suffix:
            raise InvalidRequest("suffix (fill-in-the-middle) is not supported by ember",
                                 param="suffix")
        if self.echo and self.logprobs is not None:
            raise InvalidRequest("echo with logprobs would need prompt logprobs, which ember "
                                 "does not compute; drop one of them", param="echo")


def _tool_call(call: dict[str, Any], index: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
            not isinstance(fn.get("arguments"), str):
        raise InvalidRequest(f"messages[{index}].tool_calls entries need function.name and "
                             "function.arguments (a JSON string)", param=f"messages.{index}")
    return {"id": call.get("id"), "type": "function", "function": fn}


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def as_template_message(self, index: int) -> dict[str, Any]:
        """A {role, content} dict for the chat template; content parts joined as text."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": self._text(index)}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [_tool_call(c, index) for c in self.tool_calls]
        return message

    def _text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.get("type") != "text":
                raise InvalidRequest(f"messages[{index}] has a {part.get('type')!r} content "
                                     "part; ember serves text-only models, so send text parts",
                                     param=f"messages.{index}.content")
            try:
                texts.append(TextPart.model_validate(part).text)
            except ValidationError:
                raise InvalidRequest(f"messages[{index}] has a text part without a string "
                                     "'text'", param=f"messages.{index}.content") from None
        return "".join(texts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True  # extension: False continues the last message

    def check_limits(self, max_n: int) -> None:
        super().check_limits(max_n)
        _in_range("max_tokens", self.max_tokens, 1, MAX_INT32)
        name = "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"
        self._check_max_tokens(name, self.max_new_tokens())
        _in_range("top_logprobs", self.top_logprobs, 0, MAX_LOGPROBS)
        check_messages(self.messages)
        if self.tools is not None:
            check_tool_list(self.tools)

    def check_supported(self) -> None:
        if self.tool_choice not in (None, "none") and not self.tools:
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs=true", param="top_logprobs")

    def max_new_tokens(self) -> int | None:
        """max_completion_tokens wins over the older max_tokens; None: fill the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def check_messages(messages: list[ChatMessage] | None) -> None:
    if messages is not None and len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"messages has {len(messages)} entries; send at most "
                             f"{MAX_MESSAGES}", param="messages")


def check_tool_list(tools: list[dict[str, Any]]) -> None:
    """Few and small enough tools: each becomes part of the grammar to compile."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools has {len(tools)} entries; send at most {MAX_TOOLS}",
                             param="tools")
    size = len(json.dumps(tools).encode("utf-8", "surrogatepass"))
    if size > MAX_TOOLS_BYTES:
        raise InvalidRequest(f"tools is {size} bytes as JSON; the limit is {MAX_TOOLS_BYTES}",
                             param="tools")


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, v: list[ChatMessage] | None) -> list[ChatMessage] | None:
        if v is not None and not v:
            raise ValueError("messages must not be empty")
        return v

    def check_limits(self, max_n: int) -> None:
        check_messages(self.messages)


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]

    def check_limits(self, max_n: int) -> None:
        if not all(0 <= t <= MAX_INT32 for t in self.tokens):
            raise InvalidRequest("tokens must be token ids in the vocabulary (at least 0)",
                                 param="tokens")


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of parsed JSON, stopping once past `limit`."""
    stack = [(value, 1)]
    deepest = 0
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


def _has_lone_surrogate(value: Any) -> bool:
    """JSON's \\ud800 escapes decode to a lone surrogate, which no tokenizer can encode."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


EMBEDDING_INPUT_SHAPES = ("input must be a non-empty string, a list of strings, a list of "
                          "token ids, or a list of lists of token ids (not empty)")


class EmbeddingRequest(Strict):
    """POST /v1/embeddings."""

    input: Any  # checked by inputs(): pydantic's union errors would be unreadable
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # ember (and vLLM) extensions, as on completions
    priority: int = 0                # lower runs first
    cache_salt: str | None = None

    def check_limits(self, max_n: int) -> None:
        _in_range("dimensions", self.dimensions, 1, MAX_INT32)
        _in_range("priority", self.priority, -MAX_INT32 - 1, MAX_INT32, "; lower runs first")

    def inputs(self, max_inputs: int) -> list[str | list[int]]:
        """One entry per input, at most `max_inputs` of them."""
        x = self.input
        if isinstance(x, str) or _is_ids(x):
            x = [x]
        if not isinstance(x, list) or not x or not (all(isinstance(i, str) for i in x)
                                                    or all(_is_ids(i) for i in x)):
            raise InvalidRequest(EMBEDDING_INPUT_SHAPES, param="input")
        if len(x) > max_inputs:
            raise InvalidRequest(f"input has {len(x)} entries; send at most {max_inputs} in "
                                 "one request (the server's --max-embedding-inputs)",
                                 param="input")
        empty = next((i for i, text in enumerate(x) if text == ""), None)
        if empty is not None:
            raise InvalidRequest(f"input[{empty}] is an empty string; send text to embed",
                                 param="input")
        return x

    def request_options(self) -> RequestOptions:
        return RequestOptions(priority=self.priority, user=self.user, cache_salt=self.cache_salt)


MAX_ADAPTER_NAME_CHARS = 128
MAX_ADAPTER_PATH_CHARS = 4096


class LoadLoraAdapterRequest(Strict):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1, max_length=MAX_ADAPTER_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=MAX_ADAPTER_PATH_CHARS)


class UnloadLoraAdapterRequest(Strict):
    """POST /v1/unload_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1, max_length=MAX_ADAPTER_NAME_CHARS)


def parse_body(raw: bytes, model: type[BaseModel], max_depth: int,
               max_n: int = DEFAULT_MAX_N) -> Any:
    """Bytes -> a validated request model, or an InvalidRequest that says what is wrong."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise InvalidRequest(f"the JSON body nests deeper than {max_depth} levels") from None
    except ValueError as e:  # bad JSON, bad UTF-8, or an integer of over 4300 digits
        raise InvalidRequest(f"the body is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object")
    if json_depth(data, max_depth) > max_depth:
        raise InvalidRequest(f"the JSON body nests deeper than {max_depth} levels")
    if _has_lone_surrogate(data):
        raise InvalidRequest("the body has a string with a lone UTF-16 surrogate (an unpaired "
                             "\\ud800-\\udfff escape); send valid Unicode")
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None
    check = getattr(body, "check_limits", None)
    if check is not None:
        check(max_n)
    return body


def _validation_error(error: ValidationError) -> InvalidRequest:
    first = error.errors()[0]
    param = ".".join(str(p) for p in first["loc"])
    if first["type"] == "extra_forbidden":
        return InvalidRequest(f"unknown parameter {param!r}: ember does not support it; "
                              "remove it from the request", param=param)
    if first["type"] == "missing":
        return InvalidRequest(f"missing required parameter {param!r}", param=param)
    message = f"invalid value for {param!r}: {first['msg']}"[:500]
    ranges = {name: f"{'[' if closed else '('}{low:g}, {high:g}]"
              for name, low, high, closed in FLOAT_RANGES}
    ranges["logit_bias"] = "[{:g}, {:g}]".format(*LOGIT_BIAS_RANGE)
    root = str(first["loc"][0]) if first["loc"] else ""
    if root in ranges:
        message += f"; it must be a finite number in {ranges[root]}"
    return InvalidRequest(message, param=param)
