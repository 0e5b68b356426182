import json
import os
import subprocess
import sys

from everyprompt.run.machine import cpu_model, machine


def test_cpu_model_is_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9B14\nflags\t: avx2\n")
    assert cpu_model(info) == "AMD EPYC 9B14"
    assert cpu_model(tmp_path / "missing")  # no /proc: platform's name, never an error


def test_machine_names_the_kernel_set_torch_chose():
    """ATEN_CPU_CAPABILITY changes torch's kernels (and a run's figures): the block must show it."""
    script = "import json; from everyprompt.run.machine import machine; print(json.dumps(machine('bf16')))"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    found = json.loads(subprocess.check_output([sys.executable, "-c", script], env=env, text=True))
    assert found["cpu_capability"] == "DEFAULT" and found["dtype"] == "bf16"
    here = machine()
    assert here["cpu_capability"] in {"DEFAULT", "AVX2", "AVX512", "ZVECTOR", "NEON", "SVE256", "VSX"}
    assert here["torch_threads"] >= 1 and here["cores"] >= 1 and "dtype" not in here
