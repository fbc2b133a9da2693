"""`dcp-opt bench --tp / --optimizer-sharding / --shard-domain` (issues 26, 27): every row of a
comparison runs at the one layout given, which the JSON records; a published sampler that
cannot run at it is a note, not the end of the run."""

import json

from dcp_opt.cli.main import main


def run(args, tmp_path, capsys):
    out = tmp_path / "s.json"
    code = main([*args, "--no-progress", "--json", str(out)])
    err = capsys.readouterr().err
    return code, (json.loads(out.read_text()) if code == 0 else None), err


STREAM = ["bench", "--stream", "--quick", "--epoch-batches", "2", "--cluster", "h100x64"]
WAN = ["--workloads", "3d-balanced", "--model-3d", "wan2.1-14b"]


def test_a_14b_video_model_streams_on_80gb_only_at_a_layout_that_fits(tmp_path, capsys):
    code, _, err = run([*STREAM, *WAN], tmp_path, capsys)
    assert code == 2 and "model states do not fit" in err and "--shard-domain" in err
    layout = ["--optimizer-sharding", "zero3", "--shard-domain", "8"]
    code, doc, err = run([*STREAM, *WAN, *layout], tmp_path, capsys)
    assert code == 0, err
    assert doc["config"]["optimizer_sharding"] == "zero3"
    assert (doc["config"]["shard_domain"], doc["config"]["tensor_parallel"]) == (8, 1)
    methods = {r["method"] for r in doc["methods"]}
    assert "bucket" in methods and any(m.startswith("greedy@") for m in methods)


def test_a_published_sampler_that_cannot_run_at_the_layout_is_a_note(tmp_path, capsys):
    # under --tp 2 Wan's 40 heads allow Ulysses degrees 1, 2, 4 units: the published bucket
    # sampler's degree holds no 720p clip, so its rows are left out with the reason
    code, doc, err = run([*STREAM, *WAN, "--tp", "2"], tmp_path, capsys)
    assert code == 0, err
    assert "published bucket cannot run here" in err
    methods = {r["method"] for r in doc["methods"]}
    assert "bucket" not in methods and any(m.startswith("greedy@") for m in methods)
    assert doc["config"]["tensor_parallel"] == 2


def test_the_one_batch_bench_records_its_layout(tmp_path, capsys):
    args = ["bench", "--batches", "1", "--cluster", "h200x32", "--workloads", "1d-short"]
    code, doc, err = run([*args, "--planners", "greedy", "--tp", "2"], tmp_path, capsys)
    assert code == 0, err
    assert doc["config"]["tensor_parallel"] == 2
