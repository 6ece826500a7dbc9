"""A prompt's text to the token ids vLLM's OpenAI server computes for it, from the served
model's tokenizer directory, without transformers (the index's image stays small).

vLLM (0.32) tokenizes a completion's text with ``tokenizer.encode(text,
add_special_tokens=...)`` (default true: the tokenizer's post-processor adds BOS), and
renders a chat with the model's template (transformers' way: a sandboxed jinja2
environment with ``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``tojson`` and
``strftime_now``; the special tokens as variables; ``add_generation_prompt``) before
tokenizing the text with ``add_special_tokens`` false by default. This module does the
same with ``tokenizer.json`` (the ``tokenizers`` library) and the template of
``chat_template.jinja`` or ``tokenizer_config.json``.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_RESERVED_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize"}
)
"""Template variables a request's ``chat_template_kwargs`` cannot set (vLLM's own fields
win, or it refuses the request)."""
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""What transformers appends to the final message to find where it ends once rendered."""


class PromptsError(ValueError):
    """A tokenizer directory that cannot be used; the message is one line naming the file."""


class ChatError(ValueError):
    """A conversation the template cannot render (the engine refuses it too)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: jinja2's own escapes HTML characters, which changes the
    text and so the tokens."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:200] or type(error).__name__


class Prompts:
    """Text and conversations to token ids, as the engine computes them. Thread-safe."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: str | None,
        special_tokens: Mapping[str, str],
        template_source: str = "",
    ) -> None:
        self._tokenizer = tokenizer
        self._special_tokens = dict(special_tokens)
        self._template: jinja2.Template | None = None
        self._template_text = template
        self._openai_content = False
        if template is not None:
            environment = _environment()
            try:
                self._template = environment.from_string(template)
                self._openai_content = _iterates_content(environment.parse(template))
            except jinja2.TemplateError as error:
                raise PromptsError(
                    f"{template_source or 'chat template'}: not a jinja2 template: "
                    f"{_one_line(error)}"
                ) from None

    @classmethod
    def load(cls, directory: Path) -> Prompts:
        """The tokenizer of ``directory``: ``tokenizer.json``, and the chat template of
        ``chat_template.jinja`` or else ``tokenizer_config.json``'s ``chat_template`` (a
        directory without a template tokenizes completions only)."""
        tokenizer_file = directory / TOKENIZER_FILE
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:
            raise PromptsError(f"{tokenizer_file}: not a tokenizer: {_one_line(error)}") from None
        tokenizer.no_truncation()  # vLLM asks for whole prompts (and refuses long ones)
        tokenizer.no_padding()
        config_file = directory / CONFIG_FILE
        config: dict[str, Any] = {}
        if config_file.exists():
            try:
                loaded = json.loads(config_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as error:
                raise PromptsError(f"{config_file}: not JSON: {_one_line(error)}") from None
            if not isinstance(loaded, dict):
                raise PromptsError(f"{config_file}: not a JSON object")
            config = loaded
        special = {
            name: text for name in _SPECIAL_TOKENS if (text := _token_text(config.get(name)))
        }
        template_file = directory / TEMPLATE_FILE
        if template_file.exists():
            try:
                template: str | None = template_file.read_text(encoding="utf-8")
            except (OSError, ValueError) as error:
                raise PromptsError(f"{template_file}: unreadable: {_one_line(error)}") from None
            source = str(template_file)
        else:
            template = _config_template(config.get("chat_template"), config_file)
            source = f"{config_file} chat_template"
        return cls(tokenizer, template, special, source)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A completion's text, as ``tokenizer.encode`` gives it."""
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[Any] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The conversation as the template renders it for the engine; :class:`ChatError`
        when it cannot. ``template_kwargs`` are more template variables (a request's
        ``chat_template_kwargs``, ``documents``, ``reasoning_effort``...)."""
        if self._template is None:
            raise ChatError("the tokenizer has no chat template")
        conversation = [self._message(message) for message in messages]
        final_text = ""
        if continue_final_message:
            final_text = self._tag_final(conversation)
        variables = {
            **self._special_tokens,
            **{
                key: value
                for key, value in (template_kwargs or {}).items()
                if key not in _RESERVED_VARIABLES
            },
        }
        documents = variables.pop("documents", None)
        try:
            rendered = self._template.render(
                messages=conversation,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except Exception as error:  # raise_exception, or a template tripping on the input
            raise ChatError(
                f"the chat template refused the conversation: {_one_line(error)}"
            ) from None
        if continue_final_message:
            rendered = _cut_at_tag(rendered, final_text)
        return rendered

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        tools: list[Any] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """A chat's token ids: the rendered template, tokenized (without special tokens
        unless ``add_special_tokens``: the template writes them)."""
        text = self.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            template_kwargs=template_kwargs,
        )
        return self.encode(text, add_special_tokens)

    def _message(self, message: Mapping[str, Any]) -> dict[str, Any]:
        """An OpenAI message as vLLM hands it to the template: text parts joined by newlines
        (or kept as ``{"type": "text"}`` parts for a template that loops over them), and
        the fields templates read."""
        role = message.get("role")
        parts = _text_parts(message.get("content"))
        content: Any
        if self._openai_content and role != "tool":
            content = [{"type": "text", "text": text} for text in parts]
        else:
            content = "\n".join(parts)
        out: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            if message.get("tool_calls") is not None:
                out["tool_calls"] = [_parsed_call(call) for call in message["tool_calls"]]
            if message.get("reasoning") is not None:
                out["reasoning"] = out["reasoning_content"] = message["reasoning"]
        if role == "tool" and "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        return out

    def _tag_final(self, conversation: list[dict[str, Any]]) -> str:
        final = conversation[-1]
        content = final["content"]
        if isinstance(content, list):
            if not content:
                raise ChatError("continue_final_message: the final message has no text")
            text = str(content[-1]["text"])
            content[-1] = {"type": "text", "text": text + _CONTINUE_TAG}
            return text
        final["content"] = content + _CONTINUE_TAG
        return str(content)


def _cut_at_tag(rendered: str, final_text: str) -> str:
    """transformers' cut of a rendered conversation where the final message ends."""
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ChatError("continue_final_message: the template dropped the final message")
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


def _text_parts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ChatError(f"a message's content is a {type(content).__name__}")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatError("a text part without text")
            texts.append(text)
        else:
            raise ChatError("a content part that is not text")
    return texts


def _parsed_call(call: Any) -> Any:
    """A tool call with its JSON ``arguments`` parsed, as vLLM gives templates."""
    if not isinstance(call, dict):
        return call
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        call = copy.deepcopy(call)
        with contextlib.suppress(ValueError):
            call["function"]["arguments"] = json.loads(function["arguments"])
    return call


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _config_template(value: Any, config_file: Path) -> str | None:
    """tokenizer_config.json's ``chat_template``: a string, or named templates (the one
    named ``default``)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default":
                template = entry.get("template")
                if isinstance(template, str):
                    return template
        return None
    raise PromptsError(f"{config_file}: chat_template is a {type(value).__name__}")


def _iterates_content(template: jinja2.nodes.Template) -> bool:
    """Whether the template loops over a message's content (then it gets OpenAI-style
    parts, as vLLM's content-format detection decides; a simplified form of it: a loop
    over ``x.content``/``x['content']`` or over a variable named ``content``)."""
    return any(_is_content(loop.iter) for loop in template.find_all(jinja2.nodes.For))


def _is_content(node: jinja2.nodes.Node) -> bool:
    while isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return isinstance(node, jinja2.nodes.Name) and node.name == "content"
