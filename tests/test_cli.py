"""The `graphrunner` command line: a flag per SamplingParams field, defaults in --help, --version,
--stream printing what generate prints, --logprobs lines, and one-line errors with exit status 2.

Most tests call `graphrunner.cli.main` in-process; the two that build an engine use the demo model.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import graphrunner
from graphrunner import cli
from graphrunner.outputs import CompletionOutput, RequestOutput
from graphrunner.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["Once upon a time", "The king said unto"]


def _help(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("COLUMNS", "250")  # one line per flag
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def _args(*argv: str) -> SamplingParams:
    return cli.build_sampling_params(cli.build_parser().parse_args(["generate", *argv, "a prompt"]))


def test_every_sampling_field_has_a_flag(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(cli.sampling_fields()) == names - cli.SKIPPED_FIELDS  # nothing else left out silently
    text = _help(capsys, monkeypatch)
    for name in names - cli.SKIPPED_FIELDS:
        flag = cli.FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
        assert re.search(rf"{flag}\b", text), f"no flag for SamplingParams.{name}"
    for flag in ("--no-skip-special-tokens", "--no-detokenize", "--ignore-eos", "--logit-bias ID=BIAS", "--stream",
                 "--model", "--seed", "--enforce-eager", "--cudagraph-mode", "--compile-cache", "--max-num-seqs"):
        assert flag in text


def test_help_shows_defaults(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    entries = [" ".join(e.split()) for e in re.split(r"\n(?=  -)", _help(capsys, monkeypatch))]  # one per flag

    def line(flag: str) -> str:
        return next(e for e in entries if e.startswith((flag + " ", flag + ",")))

    assert "(default: 64)" in line("--max-tokens")  # the CLI's own defaults, said so
    assert "(default: 0.7)" in line("--temperature")
    assert "(default: 1.0)" in line("--top-p")
    assert "(default: True)" in line("--skip-special-tokens")
    assert "(default: 256)" in line("--max-num-seqs")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"graphrunner {graphrunner.__version__}\n"


def test_flags_build_sampling_params() -> None:
    assert _args() == SamplingParams(max_tokens=64, temperature=0.7)  # dataclass defaults but the CLI's two
    p = _args("--n", "2", "--top-k", "5", "--top-p", "0.5", "--request-seed", "7", "--stop", "a", "--stop", "bc",
              "--stop-token-ids", "3", "--stop-token-ids", "4", "--bad-words", "x", "--logit-bias", "5=-1.5",
              "--logit-bias", "9=2", "--allowed-token-ids", "5", "--allowed-token-ids", "9", "--ignore-eos",
              "--no-skip-special-tokens", "--no-spaces-between-special-tokens", "--include-stop-str-in-output", "--logprobs", "2",
              "--prompt-logprobs", "1", "--max-tokens", "8", "--min-tokens", "2", "--presence-penalty", "0.5",
              "--truncate-prompt-tokens", "4")
    assert (p.n, p.top_k, p.top_p, p.seed, p.stop, p.stop_token_ids, p.bad_words) == (2, 5, 0.5, 7, ["a", "bc"],
                                                                                         [3, 4], ["x"])
    assert p.logit_bias == {5: -1.5, 9: 2.0} and p.allowed_token_ids == [5, 9]
    assert p.ignore_eos and p.include_stop_str_in_output and not p.skip_special_tokens
    assert not p.spaces_between_special_tokens and p.detokenize
    assert (p.logprobs, p.prompt_logprobs, p.max_tokens, p.min_tokens) == (2, 1, 8, 2)
    assert (p.presence_penalty, p.truncate_prompt_tokens) == (0.5, 4)


@pytest.mark.parametrize("argv", [["--temperature", "-1"], ["--top-p", "2"], ["--n", "0"], ["--logprobs", "21"]])
def test_bad_value_is_one_line_and_status_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", *argv, "a prompt"]) == 2  # refused before any engine is built
    err = capsys.readouterr().err
    assert err.startswith("graphrunner: error: ") and err.count("\n") == 1


@pytest.mark.parametrize("argv", [["--temperature", "abc"], ["--logit-bias", "7"], ["--no-such-flag"]])
def test_unparsable_flag_is_one_line_and_status_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", *argv, "a prompt"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("graphrunner: error: ") and err.count("\n") == 1


def test_module_entry_point_version_and_error() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GRAPHRUNNER_DEVICE": "cpu"}
    run = [sys.executable, "-m", "graphrunner"]
    proc = subprocess.run([*run, "--version"], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert (proc.returncode, proc.stdout) == (0, f"graphrunner {graphrunner.__version__}\n")
    proc = subprocess.run([*run, "generate", "--top-p", "2", "x"], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    assert proc.returncode == 2 and proc.stderr == "graphrunner: error: top_p must be in (0, 1], got 2.0\n"


def test_a_reader_that_goes_away_ends_generate_quietly() -> None:
    """`graphrunner generate --stream ... | head -c 20`: no traceback when the pipe closes, status 141 as for SIGPIPE."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GRAPHRUNNER_DEVICE": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "graphrunner", "generate", "--stream", "--ignore-eos", "--enforce-eager",
                             "--max-tokens", "1000", PROMPTS[0]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    assert len(proc.stdout.read(len(PROMPTS[0]) + 3)) == len(PROMPTS[0]) + 3  # the prompt and a first token or two
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def _completion(text: str, reason: str | None) -> CompletionOutput:
    return CompletionOutput(0, text, [1] * len(text), finish_reason=reason)


def test_stream_printer_holds_back_a_possible_stop_string(capsys: pytest.CaptureFixture[str]) -> None:
    params = SamplingParams(stop=["world"])
    printer = cli._StreamPrinter("P:", params)
    for text, reason in [("hel", None), ("hello wor", None), ("hello ", "stop")]:  # the stop string cuts the text
        printer.feed(RequestOutput("0", "P:", [1], [_completion(text, reason)], finished=reason is not None))
    assert capsys.readouterr().out == "P:hello \n  [6 tokens, finish_reason=stop]\n"


def test_stream_prints_what_generate_prints_with_logprobs(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--enforce-eager", "--temperature", "0", "--max-tokens", "12", "--n", "2", "--logprobs", "2", *PROMPTS]
    assert cli.main(argv) == 0
    plain = capsys.readouterr().out
    assert cli.main([*argv, "--stream"]) == 0
    assert capsys.readouterr().out == plain
    lines = plain.splitlines()
    assert lines[0].startswith(PROMPTS[0]) and len(lines[0]) > len(PROMPTS[0])
    assert plain.count("  [12 tokens, finish_reason=length]") == 4
    assert plain.count("  logprobs (top 2):") == 4
    token_lines = [x for x in lines if re.fullmatch(r"    \S.* -?\d+\.\d{4}( \(rank \d+\))?  top: .*", x)]
    assert len(token_lines) == 4 * 12  # one per generated token: the token, its logprob, the top 2
    assert all(len(re.findall(r" -?\d+\.\d{4}(?:, |$)", x.split("  top: ")[1])) == 2 for x in token_lines)


def test_engine_flags_reach_the_engine_arguments() -> None:
    from graphrunner.engine_args import EngineArgs

    args = cli.build_parser().parse_args(["generate", "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
                                          "--max-logprobs", "3", "--generation-config", "vllm", "--block-size", "32",
                                          "--max-model-len", "256", "-tp", "2", "x"])
    engine = EngineArgs(**cli.engine_kwargs(args))
    assert engine.tensor_parallel_size == 2
    assert (engine.enable_prefix_caching, engine.enable_chunked_prefill, engine.max_logprobs) == (False, False, 3)
    assert (engine.generation_config, engine.block_size, engine.max_model_len) == ("vllm", 32, 256)
    config = engine.create_engine_config()
    assert not config.enable_prefix_caching and not config.scheduler.enable_chunked_prefill
    assert config.tensor_parallel_size == 2
    assert cli.engine_kwargs(cli.build_parser().parse_args(["generate", "x"]))["enable_prefix_caching"] is True
