"""Chat templates: the real model's template against reference prompts, and HF Jinja semantics."""

import datetime
import json
import time
from pathlib import Path

import pytest

from edgeserve.text.chat_template import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError
from edgeserve.errors import EdgeserveError
from edgeserve.quant.gguf_file import read_gguf
from edgeserve.text.tokenizer import Tokenizer

FIXTURES = Path(__file__).parent / "fixtures"


def _cases(name: str) -> list[dict]:
    return json.loads((FIXTURES / name).read_text(encoding="utf-8"))["cases"]


TRANSFORMERS_CASES = _cases("smollm2_transformers_reference.json")
LLAMA_CPP_CASES = _cases("smollm2_llamacpp_reference.json")


@pytest.fixture(scope="module")
def smollm2(model_path) -> Tokenizer:
    return Tokenizer.from_gguf(read_gguf(model_path).metadata)


def test_gguf_template_gives_the_transformers_prompt(smollm2):
    conversation = [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Tell me about the ocean."},
    ]
    prompt = ChatTemplate.for_tokenizer(smollm2).render(conversation, add_generation_prompt=True)
    reference_ids = TRANSFORMERS_CASES[1]["prompt_ids"]
    assert prompt == smollm2.decode(reference_ids)
    assert smollm2.encode(prompt) == reference_ids


@pytest.mark.parametrize("case", LLAMA_CPP_CASES, ids=lambda c: c["messages"][-1]["content"][:30])
def test_gguf_template_matches_llama_cpp_prompts(smollm2, case):
    prompt = ChatTemplate.for_tokenizer(smollm2).render(case["messages"])
    assert prompt == case["prompt_text"]
    assert smollm2.encode(prompt) == case["prompt_ids"]


def test_add_generation_prompt_false_leaves_the_turn_closed(smollm2):
    template = ChatTemplate.for_tokenizer(smollm2)
    messages = [{"role": "user", "content": "Hi"}]
    with_prompt = template.render(messages, add_generation_prompt=True)
    without = template.render(messages, add_generation_prompt=False)
    assert with_prompt == without + "<|im_start|>assistant\n"


def test_chatml_fallback_for_models_without_a_template():
    template = ChatTemplate(None)
    assert template.source == CHATML_TEMPLATE
    prompt = template.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert (
        prompt
        == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )


def test_raise_exception_surfaces_as_a_clean_error():
    template = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversations must start with user') }}"
        "{% endif %}{{ messages[0]['content'] }}"
    )
    assert template.render([{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="^Conversations must start with user$") as caught:
        template.render([{"role": "assistant", "content": "no"}])
    assert isinstance(caught.value, EdgeserveError)


@pytest.mark.parametrize(
    "messages, message",
    [
        ([], "must not be empty"),
        ("hello", "must be a list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"content": "hi"}], r"messages\[0\] needs a 'role'"),
        (
            [{"role": "user", "content": "a"}, {"role": "user"}],
            r"messages\[1\] \(user\) needs a 'content'",
        ),
        ([{"role": "user", "content": 3}], "needs a 'content' string"),
    ],
)
def test_malformed_messages_are_refused(messages, message):
    with pytest.raises(ChatTemplateError, match=message):
        ChatTemplate(None).render(messages)


def test_broken_templates_raise_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="does not compile: line 1"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="failed to render"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render([{"role": "user", "content": "x"}])
    # Sandboxed: templates cannot reach Python internals.
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        ChatTemplate("{{ messages.__class__.__subclasses__() }}").render(
            [{"role": "user", "content": "x"}]
        )


def test_hugging_face_environment_semantics():
    template = ChatTemplate(
        "{{ bos_token }}\n"
        "{% for message in messages %}\n"
        "    {% if message['role'] == 'user' %}\n"
        "[{{ message['content'] }}]\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{{ tools | tojson }}|{{ strftime_now('%Y') }}|"
        "{% generation %}{{ eos_token }}{% endgeneration %}",
        bos_token="<s>",
        eos_token="</s>",
    )
    tools = [{"name": "météo", "html": "<b>", "z": 1, "a": 2}]
    rendered = template.render([{"role": "user", "content": "hi"}], tools=tools)
    # trim_blocks and lstrip_blocks: block tags leave no blank lines or indentation behind;
    # tojson keeps non-ASCII, HTML characters and key order as they are.
    year = datetime.datetime.now().year
    assert rendered in (
        f"<s>\n[hi]\n{json.dumps(tools, ensure_ascii=False)}|{y}|</s>" for y in (year, year + 1)
    )


HOSTILE_TEMPLATES = {
    "10^10 loop turns": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                         "took over"),
    "a huge product": ("{{ 'x' * 100000000 }}", "built a value"),
    "a string doubled in a loop": ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
                                   "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}", "built a value"),
    "a macro doubling its argument": ("{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('ab') }}", "built a value"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_TEMPLATES))
def test_a_hostile_template_fails_its_request_in_bounded_time_and_memory(kind, monkeypatch):
    import edgeserve.text.chat_template as chat_template

    monkeypatch.setattr(chat_template, "MAX_RENDER_SECONDS", 0.5)
    source, message = HOSTILE_TEMPLATES[kind]
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match=message):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    assert time.monotonic() - started < 5
    assert ChatTemplate("{% for i in range(3) %}{{ i }}{% endfor %}").render([{"role": "user", "content": "hi"}]) == "012"
