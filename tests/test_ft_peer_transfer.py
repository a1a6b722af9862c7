"""A healing state read from a peer (nanotron_ext.sparseloco.ft_peer.TensorsOnlyTransport._load_from_address): a whole
one loads; one cut short, as a peer that dies mid-transfer leaves it (torchft's server sends no length and closes the
body), is named as broken off, not as a state that is not only tensors; one whose unpickling would run code is
refused as before. Served by a local HTTP server from bytes torch's own _streaming_save wrote."""
from __future__ import annotations

import io
import os
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest
import torch

pytest.importorskip("torchft")  # the `ft` extra (in the dev extra that make setup installs)

from torch.distributed._serialization import _streaming_save  # noqa: E402

from nanotron_ext.sparseloco.ft_peer import PeerRefused, TensorsOnlyTransport  # noqa: E402


class _RunsCode:
    def __reduce__(self) -> tuple:
        return (os.getcwd, ())


def _saved(state: object) -> bytes:
    buf = io.BytesIO()
    _streaming_save(state, buf)
    return buf.getvalue()


WHOLE = _saved({"global": [torch.arange(1000, dtype=torch.float32)], "syncs": 3})
BODIES = {"whole": WHOLE, "header_cut": WHOLE[:10], "tensor_cut": WHOLE[: len(WHOLE) // 2],
          "last_bytes_cut": WHOLE[:-5], "empty": b"", "runs_code": _saved({"global": [_RunsCode()]})}


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-type", "application/octet-stream")
            self.end_headers()
            self.wfile.write(BODIES[self.path.strip("/")])

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()


def _load(base: str, name: str) -> object:
    return TensorsOnlyTransport._load_from_address(base + name, timedelta(seconds=10))


def test_a_whole_state_loads(server: str) -> None:
    state = _load(server, "whole")
    assert state["syncs"] == 3 and torch.equal(state["global"][0], torch.arange(1000, dtype=torch.float32))


@pytest.mark.parametrize("name", ["header_cut", "tensor_cut", "last_bytes_cut", "empty"])
def test_a_state_cut_short_is_named_as_broken_off(server: str, name: str) -> None:
    with pytest.raises(PeerRefused, match=r"broke off before it was complete \(the peer stopped, or the link "
                                          r"dropped\)") as e:
        _load(server, name)
    assert "not only tensors" not in str(e.value) and "\n" not in str(e.value)


def test_a_state_that_would_run_code_is_refused_as_not_only_tensors(server: str) -> None:
    with pytest.raises(PeerRefused, match="its state is not only tensors, numbers and containers"):
        _load(server, "runs_code")
