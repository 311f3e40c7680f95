"""DeepSpeed on 2 CPU ranks (gloo): one planned step equals the single-process token-mean
reference for ZeRO 0-3, padded and packed, with several uneven micro-batches per rank."""
import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(__file__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_exact_token_mean_step_for_every_zero_stage(tmp_path):
    out, port = tmp_path / "result.json", free_port()
    procs = []
    for r in range(2):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "ds_exact_worker.py"), str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    logs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:]
    results = json.loads(out.read_text())
    assert {(r["stage"], r["layout"]) for r in results} == {(s, l) for s in range(4) for l in ("padded", "packed")}
    for r in results:
        assert r["max_abs_diff"] <= 1e-5, r
        assert len(r["micro_batch_sizes"]) > 1, r  # the plan cut the step into several micro-batches
    assert any(len(set(r["micro_batch_sizes"])) > 1 for r in results)  # of uneven sizes
