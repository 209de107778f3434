import signal
import textwrap
from pathlib import Path

import httpx
import pytest

from paraseek.loadtests.server import ServerNotReady, start_server

# a stand-in checkout: its `paraseek serve` answers /readyz and says which file it runs from
pytestmark = pytest.mark.quick


FAKE_CLI = textwrap.dedent('''
    import argparse, json
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"file": __file__}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    p = argparse.ArgumentParser()
    p.add_argument("command")
    p.add_argument("--port", type=int)
    args = p.parse_args()
    HTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
''')


def fake_checkout(root: Path, cli: str = FAKE_CLI) -> Path:
    (root / "paraseek").mkdir(parents=True)
    (root / "paraseek" / "__init__.py").write_text("")
    (root / "paraseek" / "cli.py").write_text(cli)
    return root


def test_a_checkout_serves_its_own_code(tmp_path):
    checkout = fake_checkout(tmp_path / "before")
    proc, url = start_server({}, checkout=checkout, timeout=30)
    try:
        served = Path(httpx.get(url + "/anything").json()["file"])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    assert served.resolve() == (checkout / "paraseek" / "cli.py").resolve()


def test_a_checkout_whose_server_exits_fails_fast_with_its_log(tmp_path):
    checkout = fake_checkout(tmp_path / "broken", cli="raise SystemExit('no such command: serve')\n")
    with pytest.raises(ServerNotReady, match="the server exited.*no such command"):
        start_server({}, checkout=checkout, timeout=30, log=tmp_path / "server.log")
