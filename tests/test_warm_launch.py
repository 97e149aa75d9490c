"""tests/warm_launch.py, the suite's stand-in for starting torchrun and scripts, against the real thing: the
same worker environment, exit statuses, output and timeout as `python -m torch.distributed.run` and
`python script.py` give."""

import os
import subprocess
import sys

import pytest
import warm_launch

# what a rank prints: torchrun's worker variables, its argv and sys.path[0], and whether it can reach its peer
SCRIPT = """
import json, os, sys
import torch.distributed as dist
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "OMP_NUM_THREADS", "CHECK_ME"]
dist.init_process_group("gloo")
seen = [None] * dist.get_world_size()
dist.all_gather_object(seen, int(os.environ["RANK"]))
report = {"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:], "path0": sys.path[0], "peers": seen,
          "cwd": os.getcwd(), "main": __name__}
os.write(1, (json.dumps(report) + "\\n").encode())  # one write: the ranks share the output

dist.destroy_process_group()
code = int(os.environ.get("FAIL_RANK_CODE", "0")) if os.environ["RANK"] == os.environ.get("FAIL_RANK") else 0
sys.exit(code)
"""


def _both(tmp_path, cmd_tail, nproc=2, env=None):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script),
           *cmd_tail]
    env = {**os.environ, "CHECK_ME": "yes", **(env or {})}
    cold = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    warm = warm_launch.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return cold, warm


def _reports(out):
    import json

    return sorted((json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")),
                  key=lambda r: r["env"]["RANK"])


@pytest.mark.slow
def test_a_forked_launch_gives_its_ranks_what_torchrun_gives_its_workers(tmp_path):
    cold, warm = _both(tmp_path, ["a", "--flag=1"])
    assert cold.returncode == warm.returncode == 0, cold.stderr[-2000:] + warm.stderr[-2000:]
    got, want = _reports(warm), _reports(cold)
    assert len(got) == len(want) == 2
    assert got == want, (got, want)
    assert got[0]["env"]["RANK"] == "0" and got[1]["env"]["RANK"] == "1" and got[0]["peers"] == [0, 1]
    assert got[0]["argv"] == ["a", "--flag=1"] and got[0]["path0"] == str(tmp_path) and got[0]["main"] == "__main__"

    # a failed rank: torchrun stops the others and exits 1, whatever the rank's status
    cold, warm = _both(tmp_path, [], env={"FAIL_RANK": "1", "FAIL_RANK_CODE": "3"})
    assert cold.returncode == warm.returncode == 1


@pytest.mark.slow
def test_a_plain_script_keeps_its_status_output_and_timeout(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("import sys, time\nprint('out', sys.argv[1:])\nprint('err', file=sys.stderr)\n"
                      "time.sleep(float(sys.argv[2]))\nsys.exit(int(sys.argv[1]))\n")
    out = warm_launch.run([sys.executable, str(script), "7", "0"], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (7, "out ['7', '0']\n", "err\n")
    with pytest.raises(subprocess.TimeoutExpired):
        warm_launch.run([sys.executable, str(script), "0", "30"], capture_output=True, text=True, timeout=2)
    # a child that outlives the script holds its output: subprocess.run waits for it (here: times out)
    script.write_text("import os, time\nif os.fork() == 0:\n    time.sleep(30)\n")
    for launch in (subprocess.run, warm_launch.run):
        with pytest.raises(subprocess.TimeoutExpired):
            launch([sys.executable, str(script)], capture_output=True, text=True, timeout=3)
    # an uncaught exception: the traceback on stderr, status 1, as the interpreter does
    script.write_text("raise ValueError('boom')\n")
    out = warm_launch.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" in out.stderr and "ValueError: boom" in out.stderr


@pytest.mark.slow
def test_a_launch_that_sets_an_import_time_variable_gets_a_zygote_that_imported_with_it(tmp_path):
    """TRITON_INTERPRET is read when a kernel is decorated: a launch that sets it must not fork from the
    zygote that imported the kernels without it."""
    script = tmp_path / "kind.py"
    script.write_text("from flashtrain.model.kernels import index_topk as m\nprint(type(m._index_topk_kernel.fn)"
                      ".__name__)\n")
    plain = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    kinds = {}
    for interpret in ("", "1", ""):
        out = warm_launch.run([sys.executable, str(script)], env={**plain, **({"TRITON_INTERPRET": interpret}
                                                                             if interpret else {})},
                              capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        kinds.setdefault(interpret, set()).add(out.stdout.strip())
    assert kinds == {"": {"JITFunction"}, "1": {"InterpretedFunction"}}


def test_what_is_forked_and_what_is_not():
    assert warm_launch._parse([sys.executable, "x.py", "a"]) == ("x.py", ["a"], 1, False)
    assert warm_launch._parse([sys.executable, "-m", "pytest", "-q"]) == ("-m", ["pytest", "-q"], 1, False)
    assert warm_launch._parse([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                               "x.py"]) == ("x.py", [], 4, True)
    assert warm_launch._parse([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               "--no-python", sys.executable, "-c", "pass", "a"]) == ("-c", ["pass", "a"], 2, True)
    # the real torchrun for anything else: several nodes, restarts, redirects; and other programs
    assert warm_launch._parse([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "x.py"]) is None
    assert warm_launch._parse([sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts=1",
                               "x.py"]) is None
    assert warm_launch._parse(["ps", "-o", "pid="]) is None
    base = {"OMP_NUM_THREADS": "1", "PATH": "/bin"}
    assert warm_launch._import_time({**base, "TRITON_INTERPRET": "1"}) != warm_launch._import_time(base)
    assert warm_launch._import_time({**base, "PYTHONPATH": "/x", "TORCHELASTIC_ERROR_FILE": "/e",
                                     "FLASHTRAIN_DEBUG": "1"}) == warm_launch._import_time(base)
