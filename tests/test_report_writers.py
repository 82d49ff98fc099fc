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


def test_control_characters_and_lone_surrogates_from_user_names_are_written_as_text(tmp_path, capsys, monkeypatch):
    """A ModuleDict key (or a checkpoint key) with ESC/CR/LF must not drive the terminal or forge guard's lines;
    a non-UTF-8 argument must not cost the HTML report nor make the JSON invalid for strict parsers."""
    import json
    import sys

    import torch
    from torch import nn

    from guard import guard

    class Bad(nn.Module):
        def forward(self, x):
            return x * float("inf")

    evil = "d\x1b[31mRED\x1b]0;pwned\x07\r\nguard: 0 finding(s)"
    model = nn.ModuleDict({evil: Bad()})
    monkeypatch.setattr(sys, "argv", sys.argv + ["data\udcfe.txt"])
    for name in ("r.json", "r.html"):
        with guard(model, live=True, report=str(tmp_path / name)) as g:
            model[evil](torch.ones(2))
        (f,) = g.findings
        assert "\x1b" not in f.where and "\r" not in f.where and "\n" not in f.where
        assert f.where == "d\\x1b[31mRED\\x1b]0;pwned\\x07\\x0d\\x0aguard: 0 finding(s)"
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and not any(ln.startswith("guard: 0 finding") for ln in err.splitlines())

    def strict(text):
        data = json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))

        def strings(v):
            if isinstance(v, str):
                yield v
            elif isinstance(v, dict):
                for k, x in v.items():
                    yield k
                    yield from strings(x)
            elif isinstance(v, list):
                for x in v:
                    yield from strings(x)
        # a lone surrogate (written as a \udcfe escape) is rejected by strict JSON parsers
        assert not any(0xD800 <= ord(c) <= 0xDFFF for t in strings(data) for c in t)
        return data

    dump = strict((tmp_path / "r.json").read_text(encoding="utf-8"))
    assert any("data\\udcfe.txt" in a for a in dump["environment"]["argv"])
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert not any(ord(c) < 0x20 and c not in "\n\t\r" for c in page) and "\x1b" not in page
