"""benchmarks/fp8_hlo_check.py's HLO parsing (its assertions run on a GPU; here, text it would see)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import fp8_hlo_check  # noqa: E402

# The shapes of an 8B MLP: gate and up [14336, 4096] merged into one [28672, 4096] dot.
MERGED = """
%wrapped_concatenate_computation (param_0: f8e4m3fn[14336,4096], param_1: f8e4m3fn[14336,4096]) -> f8e4m3fn[28672,4096] {
  %param_0 = f8e4m3fn[14336,4096]{1,0} parameter(0)
  %param_1 = f8e4m3fn[14336,4096]{1,0} parameter(1)
  ROOT %concatenate.1 = f8e4m3fn[28672,4096]{1,0} concatenate(%param_0, %param_1), dimensions={0}
}
"""
ACTIVATIONS = """
  %concatenate.2 = f8e4m3fn[256,4096]{1,0} concatenate(%a, %b), dimensions={0}
  %concatenate.3 = bf16[28672,4096]{1,0} concatenate(%c, %d), dimensions={0}
"""


def test_a_merged_weight_concatenation_is_found():
    found = fp8_hlo_check.weight_concatenations(MERGED, 14336 * 4096)
    assert len(found) == 1 and "f8e4m3fn[28672,4096]" in found[0]


def test_activation_sized_and_non_fp8_concatenations_are_not_weights():
    assert fp8_hlo_check.weight_concatenations(ACTIVATIONS, 14336 * 4096) == []
