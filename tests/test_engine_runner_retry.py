"""``EngineProcess.wait_ready``: an engine start that lost SGLang's port race
(``EADDRINUSE`` in its log) is relaunched once; any other start failure, or a second
clash, reaches the caller. The engine itself is stubbed here (the real engine starts in
every ``tests/test_engine_*.py``)."""

from __future__ import annotations

import pytest

from sglang_evict.srt.engine_runner import EngineError, EngineProcess


def stubbed(tmp_path, monkeypatch, outcomes: list[str | None]) -> tuple[EngineProcess, list]:
    engine = EngineProcess({"model_path": "unused"}, log_path=tmp_path / "engine.log")
    launches = []

    def launch():
        launches.append(1)
        engine._log_file = open(engine.log_path, "ab")

    def once(_timeout_s):
        failure = outcomes.pop(0)
        if failure is not None:
            raise EngineError(f"engine process died while starting ()\n{failure}")
        return engine

    monkeypatch.setattr(engine, "launch", launch)
    monkeypatch.setattr(engine, "_wait_ready_once", once)
    return engine, launches


CLASH = "DistNetworkError: port: 36453, code: -98, name: EADDRINUSE, address already in use"


def test_a_port_clash_is_relaunched_once_and_logged(tmp_path, monkeypatch):
    engine, launches = stubbed(tmp_path, monkeypatch, [CLASH, None])
    assert engine.wait_ready(1) is engine
    assert len(launches) == 1
    engine._log_file.close()
    assert "retried after a port clash" in engine.log_path.read_text()


@pytest.mark.parametrize("outcomes", [["ValueError: --kv-budget must be positive"], [CLASH, CLASH]])
def test_other_failures_and_a_second_clash_reach_the_caller(tmp_path, monkeypatch, outcomes):
    engine, launches = stubbed(tmp_path, monkeypatch, list(outcomes))
    with pytest.raises(EngineError, match=outcomes[-1].split(":")[0]):
        engine.wait_ready(1)
    assert len(launches) == len(outcomes) - 1
