"""FlexibleArgumentParser accepts vLLM's spellings: underscores, -O levels, dotted JSON fields, --config YAML."""

from __future__ import annotations

from pathlib import Path

import pytest

from graphrunner.argparse_utils import FlexibleArgumentParser
from graphrunner.config import DEFAULT_COMPILE_BACKEND
from graphrunner.engine_args import EngineArgs


def _parse(argv: list[str]) -> EngineArgs:
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli_args(parser.parse_args(argv))


def test_underscores_and_equals() -> None:
    args = _parse(["--max_model_len=64", "--max_num_seqs", "3", "--enforce_eager"])
    assert (args.max_model_len, args.max_num_seqs, args.enforce_eager) == (64, 3, True)


@pytest.mark.parametrize("argv", [["-O3"], ["-O", "3"], ["-O=3"]])
def test_optimisation_level_shorthand(argv: list[str]) -> None:
    assert _parse(argv).compilation_config == 3


def test_dotted_json_fields_build_one_dict() -> None:
    args = _parse(["--compilation-config.cudagraph_mode", "PIECEWISE", "--compilation-config.level=3",
                   "--max-model-len", "32"])
    assert args.compilation_config == {"cudagraph_mode": "PIECEWISE", "level": 3} and args.max_model_len == 32
    assert args._compilation() == (False, "piecewise", None, True, DEFAULT_COMPILE_BACKEND)
    args = _parse(["--compilation-config.cudagraph_capture_sizes", "[1, 2, 4]", "--compilation-config.level=3",
                   "--compilation-config.backend", "eager"])
    assert args._compilation() == (False, "full_and_piecewise", (1, 2, 4), True, "eager")


def test_config_file_then_command_line_wins(tmp_path: Path) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text("max_model_len: 128\nenforce_eager: true\nmax_num_seqs: 4\ncompilation_config: {level: 0}\n")
    args = _parse(["--config", str(config), "--max-num-seqs", "9"])
    assert (args.max_model_len, args.enforce_eager, args.max_num_seqs) == (128, True, 9)
    assert args.compilation_config == {"level": 0}
    (tmp_path / "bad.yaml").write_text("- a list\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        _parse(["--config", str(tmp_path / "bad.yaml")])


def test_a_parser_with_its_own_config_flag_keeps_it() -> None:
    parser = FlexibleArgumentParser()
    parser.add_argument("--config")
    assert parser.parse_args(["--config", "x.yaml"]).config == "x.yaml"
