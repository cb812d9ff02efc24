"""``megatron-kd data chat``: harmony rendering and the loss mask, token by token; the chat-template path;
the files it writes; bad input as one line and exit 2. Offline: the tokenizers are built here."""

import json

import numpy as np
import pytest
from megatron_kd.cli import main as cli_main
from megatron_kd.data.chat import ConversationRenderer, build_chat_dataset
from megatron_kd.data.conversation import MaskSettings
from tests.fixtures.chat_inputs import (CHATML_SPECIALS, CHATML_TEMPLATE, HARMONY_SPECIALS, marked, megatron_tokenizer,
                                        save_tokenizer, write_jsonl)

WEATHER = {"messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "developer", "content": "# Instructions"},
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "reasoning": "call it", "content": "Checking.",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"x\":1}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sun"},
    {"role": "assistant", "thinking": "sunny", "content": "Sunny."},
]}
S, E, M, C = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    return megatron_tokenizer(save_tokenizer(tmp_path_factory.mktemp("harmony"), HARMONY_SPECIALS, eos="<|return|>"))


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return megatron_tokenizer(save_tokenizer(tmp_path_factory.mktemp("chatml"), CHATML_SPECIALS, eos="<|endoftext|>",
                                             chat_template=CHATML_TEMPLATE))


def _render(tokenizer, line, **settings):
    ids, mask, _ = ConversationRenderer(tokenizer, MaskSettings(**settings))(line)
    return marked(tokenizer, ids, mask)


def test_harmony_tool_turn_token_by_token(harmony):
    """System, developer and user messages carry no loss; the assistant's generated header (after the
    prompt's <|start|>assistant), content and end tokens do, <|call|> and the final <|return|> included;
    the tool result (functions.get to=assistant) carries none; a later message of the same turn trains its
    own <|start|>assistant."""
    assert _render(harmony, WEATHER) == (
        f"{S}system{M}Be brief.{E}{S}developer{M}# Instructions{E}{S}user{M}Weather?{E}"
        f"{S}assistant[{C}analysis{M}call it{E}{S}assistant{C}commentary{M}Checking.{E}"
        f"{S}assistant{C}commentary to=functions.get <|constrain|>json{M}{{\"x\":1}}<|call|>]"
        f"{S}functions.get to=assistant{C}commentary{M}sun{E}"
        f"{S}assistant[{C}analysis{M}sunny{E}{S}assistant{C}final{M}Sunny.<|return|>]")


def test_harmony_options_select_channels_and_header(harmony):
    line = {"messages": [{"role": "user", "content": "Hi"},
                         {"role": "assistant", "reasoning": "greet", "content": "Hello"},
                         {"role": "user", "content": "Bye"},
                         {"role": "assistant", "reasoning": "r", "content": "Ciao"}]}
    # the first turn's reasoning is dropped (harmony: no earlier chain of thought once a turn ended in final);
    # its answer ends with <|end|> in history, the last with <|return|>; EOD is <|return|>: nothing appended
    assert _render(harmony, line, loss_channels=("final",), loss_header="none") == (
        f"{S}user{M}Hi{E}{S}assistant{C}final{M}[Hello{E}]{S}user{M}Bye{E}"
        f"{S}assistant{C}analysis{M}r{E}{S}assistant{C}final{M}[Ciao<|return|>]")
    assert _render(harmony, line, loss_roles=("user", "assistant"), loss_channels=("analysis",)) == (
        f"{S}user[{M}Hi{E}]{S}assistant{C}final{M}Hello{E}{S}user[{M}Bye{E}]"
        f"{S}assistant[{C}analysis{M}r{E}]{S}assistant{C}final{M}Ciao<|return|>")


def test_chat_template_marks_what_follows_the_generation_prompt(chatml):
    line = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "Ok"},
                         {"role": "assistant", "content": "Fine"}]}
    # the template's own end of turn is trained; the EOD (<|endoftext|>) appended as the document's end is not
    assert _render(chatml, line) == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                     "<|im_start|>assistant\n[Yo<|im_end|>\n]<|im_start|>user\nOk<|im_end|>\n"
                                     "<|im_start|>assistant\n[Fine<|im_end|>\n]<|endoftext|>")


def test_dataset_files_and_sidecar(harmony, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    lines = [WEATHER, {"messages": [{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "y" * 30}]}]
    settings = MaskSettings(seq_length=80, overlong="truncate")
    summary = build_chat_dataset(write_jsonl(tmp_path / "c.jsonl", lines), tmp_path / "out" / "chat", harmony, settings)
    tokens = IndexedDataset(str(tmp_path / "out" / "chat"))
    masks = IndexedDataset(str(tmp_path / "out" / "chat_loss_mask"))
    assert len(tokens) == len(masks) == 2 and masks.index.dtype == np.uint8
    assert list(tokens.sequence_lengths) == list(masks.sequence_lengths) == [80, 80]  # both cut to --seq-length
    sidecar = json.loads((tmp_path / "out" / "chat_chat.json").read_text())
    assert sidecar == summary and sidecar["truncated"] == 2 and sidecar["renderer"] == "harmony"
    assert sidecar["loss_tokens"] == int(masks[0].sum() + masks[1].sum()) and sidecar["tokens"] == 160
    again = build_chat_dataset(tmp_path / "c.jsonl", tmp_path / "other", harmony, settings)
    assert again["fingerprint"] == sidecar["fingerprint"]  # the mask's content and settings, not its path
    other = build_chat_dataset(tmp_path / "c.jsonl", tmp_path / "other", harmony,
                               MaskSettings(seq_length=80, overlong="truncate", loss_header="none"))
    assert other["fingerprint"] != sidecar["fingerprint"]


def _tokenizer_flags(harmony):
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", harmony.path]


@pytest.mark.parametrize("lines, flags, match", [
    (['{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}', '{"messages": [}'],
     [], r"c\.jsonl:2: not a JSON line"),
    ([{"messages": [{"role": "bot", "content": "a"}]}], [], r"c\.jsonl:1: message 0 has role 'bot', expected one of"),
    ([{"messages": [{"role": "user", "content": "a" * 50}, {"role": "assistant", "content": "b"}]}],
     ["--seq-length", "20"], r"c\.jsonl:1: the conversation has \d+ tokens, more than --seq-length 20"),
    ([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]}], [],
     r"c\.jsonl:1: message 1 is an empty assistant turn"),
    ([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}],
     ["--loss-channels", "analysis"], r"c\.jsonl:1: the loss mask selects no token of this conversation"),
    ([{"messages": [{"role": "user", "content": "a" * 50}, {"role": "assistant", "content": "b"}]}],
     ["--seq-length", "20", "--overlong", "truncate"], r"c\.jsonl:1: cut to --seq-length 20 tokens"),
    ([{"messages": [{"role": "user", "content": "a"}]}], ["--loss-channels", "final,nope"],
     r"--loss-channels final,nope: expected a comma-separated list of analysis, commentary, final"),
])
def test_bad_input_is_one_line_and_exit_2(harmony, tmp_path, capsys, lines, flags, match):
    import re

    path = tmp_path / "c.jsonl"
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    capsys.readouterr()
    argv = ["data", "chat", "--input", str(path), "--output", str(tmp_path / "out"), *_tokenizer_flags(harmony), *flags]
    assert cli_main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("megatron-kd: error:") and re.search(match, err[0]), err
    assert not (tmp_path / "out.bin").exists()


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["data", "chat", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--input", "--output", "--seq-length", "--overlong", "--loss-roles", "--loss-channels",
                 "--loss-header", "--renderer", "--tokenizer-type", "--tokenizer-model"):
        assert flag in out, flag
