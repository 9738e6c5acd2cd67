"""GRAPHRUNNER_INDUCTOR_CONFIG parsing (capture.compile_settings.parse_inductor_overrides): typed values, bools for
Inductor's bool options, clear errors for malformed items and unknown options."""

from __future__ import annotations

import pytest
import torch

from capture.compile_settings import parse_inductor_overrides


def test_values_are_typed() -> None:
    got = parse_inductor_overrides(" combo_kernels=1, coordinate_descent_tuning=true,max_autotune_gemm_backends=TRITON,")
    assert got == {"combo_kernels": True, "coordinate_descent_tuning": True, "max_autotune_gemm_backends": "TRITON"}
    assert isinstance(got["combo_kernels"], bool)
    assert parse_inductor_overrides("") == {}
    name = next(n for n in ("realize_opcount_threshold", "max_fusion_size") if hasattr(torch._inductor.config, n))
    assert parse_inductor_overrides(f"{name}=7") == {name: 7}


@pytest.mark.parametrize(("raw", "match"), [("combo_kernels", "name=value"), ("=1", "name=value"),
                                            ("combo_kernels=", "name=value"), ("no_such_option=1", "no option")])
def test_bad_items_are_refused(raw: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_inductor_overrides(raw)
