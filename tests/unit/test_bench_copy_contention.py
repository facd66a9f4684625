import json

import pytest

from bench import copy_contention


def test_copy_contention_times_each_small_operation_beside_every_big_copy(tmp_path):
    copy_contention.main(["--device", "cpu", "--psi-mb", "2", "--kv-mb", "1", "--pieces-mb", "0", "0.5",
                          "--reps", "2", "--lead-ms", "0", "--out-dir", str(tmp_path), "--tag", "t"])  # fmt: skip
    written = json.loads((tmp_path / "copy-contention-cpu-t.json").read_text())
    rows = written["results"]
    cases = {("none", 0.0)} | {(big, mb) for big in ("to_host", "to_device") for mb in (0.0, 0.5)}
    assert {(r["big"], r["piece_mb"], r["small"]) for r in rows} == {
        (big, mb, small) for big, mb in cases for small in copy_contention.SMALL
    }
    for r in rows:
        assert 0 <= r["ms_p50"] <= r["ms_p90"] <= r["ms_max"]
        assert (r["reps"], r["psi_bytes"], r["kv_bytes"]) == (2, 2 << 20, 1 << 20)
        assert (r["big_copy_ms_p50"] > 0) == (r["big"] != "none")
        if r["big"] == "none":
            assert r["added_ms_p50"] == 0.0
    assert (tmp_path / "copy-contention-cpu-t.md").read_text().startswith("# copy-contention on ")


@pytest.mark.parametrize(
    "argv",
    [
        ["--reps", "0"],
        ["--psi-mb", "0"],
        ["--pieces-mb", "-1"],
        ["--lead-ms", "-1"],
        ["--paced-pieces-mb", "0"],
        ["--paced-in-flight", "0"],
        ["--kv-mb", "x"],
        ["--device", "tpu"],
    ],
)
def test_bad_arguments_are_refused_with_one_line(argv, capsys):
    with pytest.raises(SystemExit):
        copy_contention.main(["--device", "cpu", *argv])
    assert "error" in capsys.readouterr().err
