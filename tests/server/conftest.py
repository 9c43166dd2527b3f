"""The server package's subprocess servers that take seconds to start, started when the
package's first test begins: `kiln serve -tp 2` (three processes importing torch and kiln, 13 s
on a quiet 2-core machine) comes up while the in-process server tests before its module run,
instead of holding the suite while it starts. Only for a selected module; its own fixtures wait
for it and stop it."""

from __future__ import annotations

from pathlib import Path

import pytest


def _selected(request: pytest.FixtureRequest, module: str) -> bool:
    here = Path(__file__).parent
    return any(item.path == here / module for item in request.session.items)


@pytest.fixture(scope="package", autouse=True)
def early_servers(request, tmp_path_factory):
    started = {}
    if _selected(request, "test_tensor_parallel.py"):
        from tests.server.test_tensor_parallel import start_tp2_server

        started["tp2"] = start_tp2_server(tmp_path_factory.mktemp("serve-tp2"))
    yield started
    for server in started.values():
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
