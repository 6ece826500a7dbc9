"""Text prompts to token ids as vLLM computes them: a tiny tokenizer built here, read by
kvpool.index.prompts (tokenizers + jinja2) and by transformers (what vLLM uses)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvpool.index.prompts import ChatError, Prompts, PromptsError

SPECIALS = ["<unk>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
LLAMA_LIKE = (
    "{% if messages[0]['role'] == 'assistant' %}"
    "{{ raise_exception('Conversations must start with a user or system message') }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first %}{{ bos_token }}{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}{{ eos_token }}"
    "{% endfor %}\n"
    "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
PARTS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message.role }}:"
    "{% if message.content is string %} {{ message.content }}"
    "{% else %}{% for part in message.content %} [{{ part.text }}]{% endfor %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def write_tokenizer(directory: Path, template: str | None = LLAMA_LIKE) -> Path:
    """A small byte-level BPE with Llama-3-like special tokens (its post-processor adds
    BOS), saved as tokenizer.json + tokenizer_config.json with ``template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(
        [
            "The quick brown fox jumps over the lazy dog.",
            "What is the capital of France? Paris is the capital.",
            "system user assistant hello world, you are a helpful assistant",
        ],
        trainer,
    )
    bos = tokenizer.token_to_id("<|begin_of_text|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": {
            "__type": "AddedToken",
            "content": "<|eot_id|>",
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
            "special": True,
        },
    }
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def transformers_of() -> Callable[[Path], Any]:
    """transformers' tokenizer of a directory, as vLLM loads it (AutoTokenizer)."""
    from transformers import AutoTokenizer

    return lambda directory: AutoTokenizer.from_pretrained(str(directory))


def vllm_conversation(messages: list[dict[str, Any]], parts: bool) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to the template: text parts joined by newlines for a
    template that reads content as a string, kept as text parts for one that loops."""
    out = []
    for message in messages:
        content = message["content"]
        texts = [content] if isinstance(content, str) else [p["text"] for p in content]
        if parts:
            out.append({**message, "content": [{"type": "text", "text": t} for t in texts]})
        else:
            out.append({**message, "content": "\n".join(texts)})
    return out


def vllm_chat_ids(
    hf: Any, messages: list[dict[str, Any]], parts: bool = False, **kwargs: Any
) -> list[int]:
    """What vLLM's chat renderer computes: apply_chat_template(tokenize=True), i.e. the
    rendered text encoded without special tokens."""
    ids = hf.apply_chat_template(
        vllm_conversation(messages, parts), tokenize=True, return_dict=False, **kwargs
    )
    return list(ids)


CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "  hello world  "},
        {"role": "assistant", "content": "Paris is the capital."},
        {"role": "user", "content": "And the lazy dog? ünïcödé 🦊 <b>&</b>"},
    ],
    [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "The quick brown fox"},
                {"type": "text", "text": "jumps over"},
            ],
        }
    ],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_ids_are_vllms(
    tmp_path: Path,
    transformers_of: Callable[[Path], Any],
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool,
) -> None:
    directory = write_tokenizer(tmp_path / "tok")
    prompts, hf = Prompts.load(directory), transformers_of(directory)
    ours = prompts.chat(conversation, add_generation_prompt=add_generation_prompt)
    assert ours == vllm_chat_ids(hf, conversation, add_generation_prompt=add_generation_prompt)
    assert ours[0] == hf.bos_token_id and ours.count(hf.bos_token_id) == 1


def test_tools_continue_final_message_and_special_tokens_are_vllms(
    tmp_path: Path, transformers_of: Callable[[Path], Any]
) -> None:
    directory = write_tokenizer(tmp_path / "tok")
    prompts, hf = Prompts.load(directory), transformers_of(directory)
    conversation = CONVERSATIONS[1]
    tools = [{"type": "function", "function": {"name": "fox", "parameters": {"a": "<&>"}}}]
    assert prompts.chat(conversation, tools=tools) == vllm_chat_ids(
        hf, conversation, tools=tools, add_generation_prompt=True
    )
    prefill = [*conversation, {"role": "assistant", "content": "The capital is"}]
    assert prompts.chat(
        prefill, add_generation_prompt=False, continue_final_message=True
    ) == vllm_chat_ids(hf, prefill, add_generation_prompt=False, continue_final_message=True)
    # add_special_tokens on a chat: the post-processor's BOS on top of the template's
    text = prompts.render(conversation)
    assert prompts.chat(conversation, add_special_tokens=True) == hf.encode(
        text, add_special_tokens=True
    )


def test_a_template_that_loops_over_content_parts_gets_parts(
    tmp_path: Path, transformers_of: Callable[[Path], Any]
) -> None:
    directory = write_tokenizer(tmp_path / "tok", PARTS_TEMPLATE)
    prompts, hf = Prompts.load(directory), transformers_of(directory)
    for conversation in CONVERSATIONS:
        assert prompts.chat(conversation) == vllm_chat_ids(
            hf, conversation, parts=True, add_generation_prompt=True
        )
    assert "[jumps over]" in prompts.render(CONVERSATIONS[2])


@pytest.mark.parametrize(
    "text", ["hello world", "", "The  quick\nbrown fox 🦊", "<|eot_id|> is special"]
)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_completion_ids_are_vllms(
    tmp_path: Path, transformers_of: Callable[[Path], Any], text: str, add_special_tokens: bool
) -> None:
    directory = write_tokenizer(tmp_path / "tok")
    ours = Prompts.load(directory).encode(text, add_special_tokens)
    assert ours == transformers_of(directory).encode(text, add_special_tokens=add_special_tokens)
    if add_special_tokens:
        assert ours[0] == 1  # <|begin_of_text|>


def test_chat_template_jinja_is_preferred_and_no_template_refuses_chats(tmp_path: Path) -> None:
    directory = write_tokenizer(tmp_path / "tok", template=None)
    prompts = Prompts.load(directory)
    assert not prompts.has_chat_template
    with pytest.raises(ChatError, match="no chat template"):
        prompts.chat(CONVERSATIONS[0])
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Prompts.load(directory).render(CONVERSATIONS[0]).endswith("France?!")


def test_a_template_raise_exception_is_a_chat_error(tmp_path: Path) -> None:
    prompts = Prompts.load(write_tokenizer(tmp_path / "tok"))
    with pytest.raises(ChatError, match="must start with a user or system message"):
        prompts.chat([{"role": "assistant", "content": "hi"}])
    with pytest.raises(ChatError, match="not text"):
        prompts.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_bad_files_are_one_line_errors_naming_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(PromptsError) as caught:
        Prompts.load(missing)
    assert str(missing / "tokenizer.json") in str(caught.value)
    assert "\n" not in str(caught.value)

    directory = write_tokenizer(tmp_path / "tok")
    (directory / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(PromptsError, match=r"tokenizer_config\.json: not JSON") as caught:
        Prompts.load(directory)
    assert "\n" not in str(caught.value)

    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(PromptsError, match=r"tokenizer_config\.json chat_template: not a jinja2"):
        Prompts.load(directory)

    (directory / "chat_template.jinja").write_text("{% for x in %}")
    with pytest.raises(PromptsError, match=r"chat_template\.jinja: not a jinja2") as caught:
        Prompts.load(directory)
    assert "\n" not in str(caught.value)

    (directory / "tokenizer.json").write_text("{}")
    with pytest.raises(PromptsError, match=r"tokenizer\.json: not a tokenizer"):
        Prompts.load(directory)


def test_the_template_sandbox_refuses_python_internals(tmp_path: Path) -> None:
    """The template is the operator's, the messages the client's: a message cannot reach
    Python through the template, and a template that tries is refused when rendered."""
    directory = write_tokenizer(tmp_path / "tok", "{{ messages[0]['content'].__class__.__mro__ }}")
    with pytest.raises(ChatError, match="refused"):
        Prompts.load(directory).render(CONVERSATIONS[0])
