"""``python -m benchmarks.host`` (the host cost per call, ours vs PyTorch's): it runs every
case through the public API, writes its rows with the versions, and rejects bad values with a
one-line error naming the flag. A smoke test: timings on a shared CPU say nothing."""
import json

import pytest

from benchmarks import host


def test_host_benchmark_writes_every_case(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")   # main() sets it to 0 (the fallback) on CPU
    assert host.main(["--device", "cpu", "--shape", "1x2x8x8", "--budget", "0.01",
                      "--inner", "1", "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-host.json")
    data = json.loads(path.read_text())
    cases = {r["case"]: r for r in data["rows"]}
    assert {"attention fwd", "sdpa fwd", "attention fwd+bwd", "attention p=0.1 fwd+bwd",
            "FusedMultiHeadAttention fwd+bwd", "attention_with_kvcache decode",
            "attention_varlen fwd", "flash_attn_func fwd"} <= set(cases)
    assert data["meta"]["torch"] and "fallback" in data["meta"]["what"]
    r = cases["attention fwd+bwd"]
    assert r["baseline"] == "sdpa fwd+bwd" and r["x_baseline_p20"] > 0
    assert 0 < r["min_us"] <= r["p20_us"] <= r["median_us"]
    assert (tmp_path / path.name.replace(".json", ".csv")).exists()


@pytest.mark.parametrize("argv, flag", [(["--shape", "1x0x8x8"], "--shape"),
                                        (["--budget", "-1"], "--budget"),
                                        (["--inner", "0"], "--inner")])
def test_host_benchmark_rejects_bad_values(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        host.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert flag in err and "error" in err
