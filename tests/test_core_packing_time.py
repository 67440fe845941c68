"""PackingTime (csrc/core/packing_time.h, Note [Packing time]) on its own: a small program over
the header, compiled here, since its credit is a matter of wall-clock time."""
import shutil
import subprocess

import pytest

from _harness import REPO

PROGRAM = r"""
#include "core/packing_time.h"

#include <chrono>
#include <cstdio>
#include <thread>

using namespace std::chrono_literals;

int main() {
  tb::PackingTime p;
  p.set_share(0.5);
  // A move that took longer than the burst leaves the credit below zero: no move now.
  p.may_move();
  p.spent(30ms, 0ms, 0.0);
  const bool right_after = p.may_move();
  // Waiting earns half of the time waited, up to the burst: enough for a move.
  std::this_thread::sleep_for(80ms);
  const bool after_waiting = p.may_move();
  p.spent(30ms, 0ms, 0.0);
  // The same wait, said to be idle (a process paused on purpose): it earns nothing.
  std::this_thread::sleep_for(80ms);
  p.idle();
  const bool after_idle = p.may_move();
  // Starting over (a benchmark's next trace, as a process of its own): a full burst at once.
  p.refill();
  const bool after_refill = p.may_move();
  std::printf("%d %d %d %d\n", right_after, after_waiting, after_idle, after_refill);
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to compile the header's test program")
def test_waiting_earns_packing_credit_unless_the_wait_was_idle_and_a_refill_gives_a_burst(tmp_path):
    src = tmp_path / "packing_time.cpp"
    src.write_text(PROGRAM)
    exe = tmp_path / "packing_time"
    subprocess.run(["g++", "-std=c++17", "-O1", "-I", str(REPO / "csrc"), str(src), "-o", str(exe)], check=True,
                   capture_output=True, text=True, timeout=120)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=60).stdout.split()
    assert out == ["0", "1", "0", "1"], out
