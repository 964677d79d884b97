"""Markstein's quotient (``quotient`` in ``wiola/fast/decode_step_cpu.cpp``, what the prompt's
attention divides by) against the division, bitwise, on this CPU's AVX-512 and AVX2 variants:

1. every significand of x in [1, 2) (2^23 values) for each of 16,384 random divisor significands in
   [1, 2) and a few chosen ones (all ones, 1 + 1 ulp, sqrt(D) for common head widths, 3, 7). Scaling x
   or d by a power of two scales x/d and the quotient alike while nothing is subnormal, so this covers
   every pair of significands those divisors have, at every exponent of the domain;
2. the ends of the domain: x in the binades of 2^-100, 2^99 and 2^-1, d in those of 2^-20, 2^19 and 1,
   random significands (2^20 pairs each).

A C++ program that includes the library's source (so the same ``quotient`` is inlined) is built
with the variant's flags and run on torch's threads count of OpenMP threads.

    python verify_divide.py
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from wiola.fast import decode_step_cpu as dsc  # noqa: E402

PROGRAM = r"""
#include "%(source)s"
#include <cstdio>
#include <random>

// How many lanes of quotient(x, d, 1/d) differ from x / d in their bits.
int differ(vec x, float d) {
  const vec q = quotient(x, d, 1.0f / d), want = x / d;
  int n = 0;
  for (int l = 0; l < kLanes; ++l) n += std::memcmp(&q[l], &want[l], 4) != 0;
  return n;
}

int main() {
  std::mt19937_64 gen(20261206);
  std::vector<float> divisors = {1.0f, 1.9999999f, 1.0000001f, 1.5f, 1.75f, std::sqrt(10.0f), std::sqrt(32.0f) / 4,
                                 std::sqrt(40.0f) / 4, std::sqrt(128.0f) / 8, std::sqrt(2.0f), 1.5f * 1.3333334f};
  std::uniform_int_distribution<uint32_t> mant(0, (1u << 23) - 1);
  for (int i = 0; i < (1 << 14); ++i) {
    uint32_t bits = 0x3f800000u | mant(gen);
    float d;
    std::memcpy(&d, &bits, 4);
    divisors.push_back(d);
  }
  long long checked = 0, wrong = 0;
#pragma omp parallel for schedule(dynamic, 16) reduction(+ : checked, wrong)
  for (size_t i = 0; i < divisors.size(); ++i) {
    for (uint32_t m = 0; m < (1u << 23); m += kLanes) {
      ivec bits;
      for (int l = 0; l < kLanes; ++l) bits[l] = static_cast<int32_t>(0x3f800000u | (m + l));
      vec x;
      std::memcpy(&x, &bits, sizeof(x));
      wrong += differ(x, divisors[i]);
      checked += kLanes;
    }
  }
  std::printf("significands: %%zu divisors x 2^23 significands of x: %%lld pairs, %%lld differ\n", divisors.size(),
              checked, wrong);
  const int x_exp[] = {-100, 99, -1}, d_exp[] = {-20, 19, 0};
  long long ends = 0, ends_wrong = 0;
  for (int xe : x_exp)
    for (int de : d_exp) {
      for (int i = 0; i < (1 << 20); i += kLanes) {
        const float d = std::ldexp(1.0f + mant(gen) * 0x1p-23f, de);
        vec x;
        for (int l = 0; l < kLanes; ++l) x[l] = std::ldexp(1.0f + mant(gen) * 0x1p-23f, xe) * ((l & 1) ? -1.0f : 1.0f);
        ends_wrong += differ(x, d);
        ends += kLanes;
      }
    }
  std::printf("ends of the domain: %%lld pairs, %%lld differ\n", ends, ends_wrong);
  return wrong + ends_wrong != 0;
}
"""


def main() -> int:
    cpu = dsc.cpu_info()
    print(f"{cpu['name']}, {cpu['vendor']}")
    features, _ = dsc.cpu_features()
    status = 0
    for isa in ("avx512", "avx2"):
        if not set(dsc.ISA_NEEDS[isa]) <= features:
            print(f"{isa}: this CPU lacks it, not run")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            src, exe = Path(tmp) / "verify.cpp", Path(tmp) / "verify"
            src.write_text(PROGRAM % {"source": dsc.SOURCE})
            flags = [f for f in (*dsc.FLAGS, *dsc.ISA_FLAGS[isa]) if f not in ("-shared", "-fPIC")]
            subprocess.run([*dsc.compiler_command(dsc._compiler()), *flags, str(src), "-o", str(exe)], check=True)
            proc = subprocess.run([str(exe)], capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "2"})
            print(f"{isa}:\n{proc.stdout.rstrip()}")
            status |= proc.returncode
    return status


if __name__ == "__main__":
    raise SystemExit(main())
