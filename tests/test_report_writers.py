"""Several writers, one report path: threads of one process (issue 15, item 6)."""
import json
import threading

import torch
from torch import nn

from guard import guard
from guard.report import atomic_write


def _race(n_threads, fn):
    barrier = threading.Barrier(n_threads)
    errors = []

    def run(i):
        try:
            barrier.wait()
            fn(i)
        except BaseException as exc:  # noqa: BLE001 - every failure counts
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_two_threads_writing_one_path_never_collide(tmp_path):
    path = tmp_path / "r.json"
    texts = [json.dumps({"writer": i, "pad": "x" * 20000}) for i in range(2)]
    for _ in range(60):
        errors = _race(2, lambda i: atomic_write(str(path), texts[i]))
        assert errors == []
        assert json.loads(path.read_text())["writer"] in (0, 1)  # one whole file, never a mix
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temp file left behind


def test_two_guards_in_two_threads_with_one_report_path(tmp_path):
    path = tmp_path / "guard-report.json"
    results = [None, None]

    def train(i):
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with guard(model, opt, report=str(path), live=False) as g:
            x = torch.randn(4, 3)
            x[0, 0] = float("nan")
            model(x).sum().backward()
            opt.step()
        results[i] = g

    train(0)  # first use in one thread (check discovery imports modules; see the report for two threads at once)
    for _ in range(30):
        assert _race(2, train) == []
        assert all(g.report_error is None for g in results), [g.report_error for g in results]
        dump = json.loads(path.read_text())
        assert [f["kind"] for f in dump["findings"]] == ["nonfinite-input"]
    assert [p.name for p in tmp_path.iterdir()] == ["guard-report.json"]
