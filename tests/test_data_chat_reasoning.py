"""An assistant turn's reasoning (``reasoning_content``, or ``<think>...</think>`` inline in its content)
rendered by the model's chat template: supervised with the turn from the end of its generation prompt,
refused wherever it would be dropped (csbp's role markers, another role, a template that does not render
it, a history turn under ``--chat-documents record``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import test_data_chat_turns as shared
from csbp.data import prepare as prepare_module
from csbp.data.artifact import open_artifact
from csbp.data.chat_template import ChatTemplate
from csbp.data.packing import encode_documents, turn_documents
from csbp.data.prepare import PrepareConfig, prepare_artifact
from csbp.data.sources import record_to_document
from csbp.data.tokenizer import CsbpTokenizer, load_tokenizer
from test_data_chat_template import CHATML, build_tokenizer_dir
from test_data_chat_turns import run_cli, supervised_runs

THINKING = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] != 'assistant' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% set thought = m['reasoning_content'] if m['reasoning_content'] is string else '' %}"
    "{% set answer = m['content'] %}"
    "{% if thought == '' and '</think>' in answer %}"
    "{% set thought = answer.split('</think>')[0].split('<think>')[-1] %}{% set answer = answer.split('</think>')[-1] %}"
    "{% endif %}"
    "<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_user %}<think>\n{{ thought.strip('\n') }}\n</think>\n\n{% endif %}"
    "{{ answer.lstrip('\n') }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Written for these tests in the manner of Qwen3's: the reasoning (reasoning_content, else split out
of the content) is written in a think block for assistant turns after the last user turn only; a turn
a user turn follows is history, its answer alone."""
DROPPING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""In the manner of DeepSeek-R1's: inline reasoning is cut from every assistant turn, reasoning_content ignored."""

SYSTEM = {"role": "system", "content": "Answer briefly."}
ASK_1, ASK_2 = {"role": "user", "content": "What is two plus two?"}, {"role": "user", "content": "Name a colour."}
THOUGHT_1, THOUGHT_2 = "Two and two make four.", "The sky is blue."
REPLY_1 = {"role": "assistant", "content": "It is four.", "reasoning_content": THOUGHT_1}
REPLY_2 = {"role": "assistant", "content": "Blue.", "reasoning_content": "\n" + THOUGHT_2 + "\n"}
CHAT = [SYSTEM, ASK_1, REPLY_1, ASK_2, REPLY_2]
TURN_1 = f"<think>\n{THOUGHT_1}\n</think>\n\nIt is four.<|im_end|>"
TURN_2 = f"<think>\n{THOUGHT_2}\n</think>\n\nBlue.<|im_end|>"


chatml_dir, tokenizer = shared.chatml_dir, shared.tokenizer  # the module fixtures, shared


def encode(messages: list[dict[str, str]], template: str | None, tokenizer: CsbpTokenizer, per: str = "turn",
           ) -> list[tuple[np.ndarray, np.ndarray]]:
    document = record_to_document({"messages": messages}, "chat.jsonl:1")
    documents = turn_documents(document) if per == "turn" else [document]
    return encode_documents(documents, tokenizer, ChatTemplate(template, "t.jinja") if template else None)


def test_turn_documents_supervise_the_reasoning_scaffolding_and_answer_exactly(tokenizer: CsbpTokenizer) -> None:
    encoded = encode(CHAT, THINKING, tokenizer)
    template = ChatTemplate(THINKING, "t.jinja")
    assert [supervised_runs(ids, mask, tokenizer) for ids, mask in encoded] == [[TURN_1], [TURN_2]]
    for (ids, mask), end in zip(encoded, (3, 5)):
        assert ids[:-1].tolist() == tokenizer.encode(template.render(CHAT[:end]))  # the text as the template renders it
        assert mask[-1] == 0  # <|im_end|> is the stop
    # the second document holds the first turn as the template writes history: its answer alone, unsupervised
    later = tokenizer.decode(encoded[1][0].tolist())
    assert "<|im_start|>assistant\nIt is four.<|im_end|>\n<|im_start|>user" in later and THOUGHT_1 not in later
    # what is supervised is exactly what the model writes after its generation prompt
    for (ids, mask), end in zip(encoded, (3, 5)):
        prompt = template.render(CHAT[: end - 1], add_generation_prompt=True)
        assert template.render(CHAT[:end]) == prompt + supervised_runs(ids, mask, tokenizer)[0] + "\n"


def test_record_documents_refuse_a_turn_whose_reasoning_becomes_history(tokenizer: CsbpTokenizer) -> None:
    with pytest.raises(ValueError, match=r"^chat\.jsonl:1: chat template t\.jinja drops the reasoning of messages\[2\] "
                       r"once messages\[3\] follows .*\(fix: --chat-documents turn,"):
        encode(CHAT, THINKING, tokenizer, per="record")
    # a record whose reasoning stays (its one assistant turn is the last): the same tokens either way
    [(ids, mask)] = encode(CHAT[:3], THINKING, tokenizer, per="record")
    [(turn_ids, turn_mask)] = encode(CHAT[:3], THINKING, tokenizer)
    assert supervised_runs(ids, mask, tokenizer) == [TURN_1]
    assert np.array_equal(ids, turn_ids) and np.array_equal(mask, turn_mask)


def test_inline_reasoning_split_by_the_template_is_supervised_as_reasoning_content(tokenizer: CsbpTokenizer) -> None:
    inline = [{**m, "content": f"<think>\n{m['reasoning_content']}</think>\n\n{m['content']}"} if "reasoning_content" in m
              else m for m in CHAT]
    inline = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in inline]
    by_field = encode(CHAT, THINKING, tokenizer)
    for (ids, mask), (field_ids, field_mask) in zip(encode(inline, THINKING, tokenizer), by_field):
        assert np.array_equal(ids, field_ids) and np.array_equal(mask, field_mask)
    # a template that keeps the tags in the content trains them as content, as the model writes them
    [(ids, mask)] = encode(inline[:3], CHATML, tokenizer)
    assert supervised_runs(ids, mask, tokenizer) == [inline[2]["content"] + "<|im_end|>"]
    # one that cuts them out would train the answer without its reasoning
    with pytest.raises(ValueError, match=r"^chat\.jsonl:1: chat template t\.jinja does not render messages\[2\]\.content, "
                       r"which holds </think>, as given: .*\(fix: put the reasoning in messages\[2\]\.reasoning_content"):
        encode(inline[:3], DROPPING, tokenizer)


def test_a_template_that_does_not_render_the_reasoning_is_refused(tokenizer: CsbpTokenizer) -> None:
    for template in (CHATML, DROPPING):
        with pytest.raises(ValueError, match=r"^chat\.jsonl:1: chat template t\.jinja does not render "
                           r"messages\[2\]\.reasoning_content exactly once as given .*\(fix: a template that renders"):
            encode(CHAT[:3], template, tokenizer)
    shouting = THINKING.replace("{{ answer.lstrip('\n') }}", "{{ answer.lstrip('\n') | upper }}")
    with pytest.raises(ValueError, match=r"does not render messages\[2\]\.content exactly once as given in a turn with "
                       r"reasoning"):
        encode(CHAT[:3], shouting, tokenizer)
    no_prompt = THINKING.replace("<|im_start|>assistant\n{% endif %}", "{% endif %}")
    with pytest.raises(ValueError, match=r"renders messages\[2\] with its reasoning as text that does not continue its "
                       r"generation prompt"):
        encode(CHAT[:3], no_prompt, tokenizer)
    # a turn without reasoning is supervised as before: from its content (THINKING's empty think block is
    # the prompt of a model answering without thinking)
    plain = {k: v for k, v in REPLY_1.items() if k != "reasoning_content"}
    [(ids, mask)] = encode([SYSTEM, ASK_1, plain], THINKING, tokenizer)
    assert supervised_runs(ids, mask, tokenizer) == ["It is four.<|im_end|>"]


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({**ASK_1, "reasoning_content": "hm"}, r"messages\[1\]\.reasoning_content is set on a user message; only an "
                                              r"assistant turn carries reasoning \(fix: remove the field"),
        ({**SYSTEM, "reasoning_content": "hm"}, r"messages\[1\]\.reasoning_content is set on a system message"),
        ({**REPLY_1, "reasoning_content": ["hm"]}, r"messages\[1\]\.reasoning_content must be a string, got list"),
    ],
)
def test_reasoning_anywhere_but_on_an_assistant_turn_is_refused(message: dict, error: str) -> None:
    with pytest.raises(ValueError, match=rf"^chat\.jsonl:4: {error}"):
        record_to_document({"messages": [SYSTEM, message]}, "chat.jsonl:4")


def test_reasoning_is_kept_for_the_tokenizer_and_empty_reasoning_is_none() -> None:
    document = record_to_document({"messages": CHAT}, "r:1")
    assert document.reasoning == ("", "", THOUGHT_1, "", REPLY_2["reasoning_content"]) and document.first_reasoning() == 2
    assert THOUGHT_1 in document.texts()  # a tokenizer trained on the data sees the reasoning too
    assert [d.reasoning for d in turn_documents(document)] == [document.reasoning[:3], document.reasoning]
    empty = record_to_document({"messages": [ASK_1, {**REPLY_1, "reasoning_content": ""}]}, "r:2")
    assert empty.reasoning == () and empty.first_reasoning() is None


def test_without_a_template_reasoning_is_refused_before_any_work(
    tmp_path: Path, chatml_dir: Path, tokenizer: CsbpTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    fix = r"\(fix: --chat-template PATH naming a template that renders reasoning_content"
    with pytest.raises(ValueError, match=rf"^chat\.jsonl:1: messages\[2\]\.reasoning_content is set, but without a chat "
                       rf"template the chat is written with csbp's role markers, .*{fix}"):
        encode(CHAT, None, tokenizer, per="record")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"text": "Blue."}) + "\n" + json.dumps({"messages": CHAT}) + "\n", encoding="utf-8")
    monkeypatch.setattr(prepare_module, "encode_documents", lambda *a, **k: pytest.fail("encoded"))
    monkeypatch.setattr(prepare_module, "_train_tokenizer", lambda *a, **k: pytest.fail("trained"))
    options = {"inputs": (data,), "out_dir": tmp_path / "art", "seq_len": 8}
    for config in (PrepareConfig(**options, tokenizer_path=chatml_dir, chat_template="none"),  # --chat-template none
                   PrepareConfig(**options, train_tokenizer=True, vocab_size=300)):  # no tokenizer, so no template
        with pytest.raises(ValueError, match=rf"^{data}:2: messages\[2\]\.reasoning_content is set, .*{fix}"):
            prepare_artifact(config)
    assert not (tmp_path / "art").exists()


def test_cli_prepare_and_inspect_show_nothing_new(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = build_tokenizer_dir(tmp_path / "tok", "chatml")
    (directory / "chat_template.jinja").write_text(THINKING, encoding="utf-8")
    manifests, shown = [], []
    for name, messages in (("plain", [{k: v for k, v in m.items() if k != "reasoning_content"} for m in CHAT]),
                           ("thinking", CHAT)):
        data = tmp_path / f"{name}.jsonl"
        data.write_text(json.dumps({"messages": messages}) + "\n", encoding="utf-8")
        out = tmp_path / name
        argv = ["data", "prepare", str(data), "--tokenizer", str(directory), "--seq-len", "16", "--out", str(out),
                "--chat-documents", "turn"]
        assert run_cli(argv) == 0
        manifests.append(open_artifact(out, verify=True).manifest)
        capsys.readouterr()
        assert run_cli(["data", "inspect", str(out), "--rows", "0"]) == 0
        shown.append([line for line in capsys.readouterr().out.splitlines() if not line[:1].isspace()])
    plain, thinking = manifests
    assert plain.keys() == thinking.keys() and plain["options"] == thinking["options"]
    assert plain["chat_template"] == thinking["chat_template"]
    assert thinking["splits"]["train"]["documents"] == 2
    assert thinking["splits"]["train"]["supervised_tokens"] > plain["splits"]["train"]["supervised_tokens"]
    # the same lines, the chat ones identical, but for the artifact's name, counts and content hash
    assert [line.split()[:1] for line in shown[0]] == [line.split()[:1] for line in shown[1]]
    assert [line for line in shown[0] if line.startswith("chat")] == [line for line in shown[1] if line.startswith("chat")]


def test_reasoning_reaches_the_prepare_workers(tmp_path: Path) -> None:
    """``--workers 2`` renders in other processes: the reasoning must travel with the documents (the
    same artifact, byte for byte, as one process, with the reasoning supervised)."""
    directory = build_tokenizer_dir(tmp_path / "tok", "chatml")
    (directory / "chat_template.jinja").write_text(THINKING, encoding="utf-8")
    data = tmp_path / "thinking.jsonl"
    data.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(3)), encoding="utf-8")
    outs = []
    for workers in (1, 2):
        outs.append(tmp_path / f"w{workers}")
        argv = ["data", "prepare", str(data), "--tokenizer", str(directory), "--seq-len", "16", "--out",
                str(outs[-1]), "--chat-documents", "turn", "--workers", str(workers)]
        assert run_cli(argv) == 0
    names = sorted(path.name for path in outs[0].iterdir() if path.suffix == ".bin")
    assert names and names == sorted(path.name for path in outs[1].iterdir() if path.suffix == ".bin")
    for name in names:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    supervised = open_artifact(outs[1], verify=True).manifest["splits"]["train"]["supervised_tokens"]
    plain = encode([{k: v for k, v in m.items() if k != "reasoning_content"} for m in CHAT], THINKING,
                   load_tokenizer(directory), per="turn")
    assert supervised > 3 * sum(int(sum(mask)) for _, mask in plain)
