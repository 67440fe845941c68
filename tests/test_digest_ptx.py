"""The digest kernel ships as PTX in csrc/core/digest_ptx.h (Note [Retained backups]): the
header must be what tools/gen_digest_ptx.sh writes from csrc/kernels/digest.cu, and the
PTX must assemble for the oldest and the newest architectures it claims."""
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEADER = ROOT / "csrc" / "core" / "digest_ptx.h"


def ptx_of(text):
    return text.split('R"PTX(', 1)[1].split(')PTX"', 1)[0]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has the toolkit)")
def test_the_header_is_what_the_script_writes_from_the_kernel(tmp_path):
    committed = HEADER.read_text()
    release = re.search(r"release [0-9.]+", subprocess.run(["nvcc", "--version"], capture_output=True,
                                                           text=True).stdout).group(0)
    if release not in committed.splitlines()[1]:
        pytest.skip(f"the header was written by nvcc {committed.splitlines()[1][3:]}, this is {release}")
    out = tmp_path / "digest_ptx.h"
    subprocess.run(["bash", str(ROOT / "tools" / "gen_digest_ptx.sh"), str(out)], check=True)
    assert out.read_text() == committed, "csrc/core/digest_ptx.h is stale: run tools/gen_digest_ptx.sh"


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (CI has the toolkit)")
@pytest.mark.parametrize("arch", ["sm_75", "sm_90"])
def test_the_ptx_assembles(tmp_path, arch):
    ptx = tmp_path / "digest.ptx"
    ptx.write_text(ptx_of(HEADER.read_text()))
    subprocess.run(["ptxas", f"-arch={arch}", str(ptx), "-o", str(tmp_path / "digest.cubin")], check=True)


def test_the_ptx_defines_the_kernel_the_core_launches():
    ptx = ptx_of(HEADER.read_text())
    assert ".visible .entry tb_digest(" in ptx
    assert re.search(r"^\.version 7\.0$", ptx, re.M), "lowered so older drivers compile it"
    assert '"tb_digest"' in (ROOT / "csrc" / "core" / "digest.cpp").read_text()
