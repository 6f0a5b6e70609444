"""The package as users install it: a wheel built from the repository root by maturin, installed
into a fresh virtual environment with its dependencies, runs ``shoal`` and a collective."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_built_wheel_installs_and_runs(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(["maturin", "build", "--release", "--quiet", "-o", str(wheels)], cwd=ROOT, check=True,
                   capture_output=True, timeout=900)
    (wheel,) = wheels.glob("shoal-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, str(wheel)], check=True, capture_output=True, timeout=600)
    version = subprocess.run([str(venv / "bin" / "shoal"), "--version"], capture_output=True, text=True, timeout=60)
    assert version.stdout.startswith("shoal ") and version.returncode == 0, version.stderr
    program = (
        "import numpy as np, shoal\n"
        "with shoal.Master('127.0.0.1:0') as m, shoal.Communicator(m.address) as c:\n"
        "    c.connect(timeout=30)\n"
        "    x = np.arange(5, dtype=np.float32)\n"
        "    c.all_reduce(x)\n"
        "    print(shoal.__file__, x.tolist())\n"
    )
    run = subprocess.run([str(venv / "bin" / "python"), "-c", program], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    where, values = run.stdout.split(" ", 1)
    assert where.startswith(str(venv)), "the installed package ran, not the repository's"
    assert values.strip() == "[0.0, 1.0, 2.0, 3.0, 4.0]"
