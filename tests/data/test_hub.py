"""Without the network (or without the [hub] extra) every hub failure is one line that says what to use
instead. The hub libraries are replaced by stand-ins that fail the way an offline machine does: no test here
reaches the network."""

from __future__ import annotations

import socket
import sys
import types

import pytest

from pilotrun.commands.cli import main
from pilotrun.common.errors import DataError
from pilotrun.data.hub import OFFLINE_HINTS, HuggingFaceHub


def offline(*args, **kwargs):
    raise OSError("Failed to resolve 'huggingface.co' ([Errno -3] Temporary failure in name resolution)\n"
                  "Traceback-like second line that must not reach the user")


@pytest.fixture
def offline_hub_libraries(monkeypatch):
    class HfApi:
        dataset_info = model_info = staticmethod(offline)

    hub_module = types.ModuleType("huggingface_hub")
    hub_module.HfApi = HfApi
    hub_module.hf_hub_download = offline
    datasets_module = types.ModuleType("datasets")
    datasets_module.load_dataset = offline
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub_module)
    monkeypatch.setitem(sys.modules, "datasets", datasets_module)
    monkeypatch.setattr(socket, "getaddrinfo", offline)  # belt and braces: nothing may reach the network


@pytest.mark.parametrize("call, repo_type", [
    (lambda hub: hub.resolve_revision("HuggingFaceFW/fineweb-edu", "main", "dataset"), "dataset"),
    (lambda hub: list(hub.stream_rows("HuggingFaceFW/fineweb-edu", "sample-10BT", "0" * 40)), "dataset"),
    (lambda hub: hub.resolve_revision("gpt2", "main", "model"), "model"),
    (lambda hub: hub.download_file("gpt2", "tokenizer.json", "0" * 40), "model"),
])
def test_offline_hub_errors_are_one_line_with_the_local_alternative(offline_hub_libraries, call, repo_type):
    with pytest.raises(DataError) as caught:
        call(HuggingFaceHub())
    message = str(caught.value)
    assert "\n" not in message
    assert message.endswith(OFFLINE_HINTS[repo_type])
    assert "OSError" in message


@pytest.mark.parametrize("argv", [["--source", "fineweb-edu"], ["--tokenizer", "hub:gpt2"]])
def test_prepare_offline_exits_2_with_one_line_and_writes_nothing(
    offline_hub_libraries, tmp_path, capsys, argv
):
    out = tmp_path / "data"
    assert main(["prepare", "--out", str(out), *argv]) == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1
    assert not out.exists()


def test_missing_hub_extra_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import raises ImportError
    with pytest.raises(DataError, match=r"\[hub\]"):
        HuggingFaceHub().resolve_revision("gpt2", "main", "model")
