"""`make lab` (scripts/lab): a headless JupyterLab any user can start, root included.

The server is started as `make lab` starts it; the test then works through its REST and
websocket APIs as the browser would: the project's kernel is registered, notebooks/train.ipynb
opens through the contents API, and a cell of it runs in that kernel.
"""

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parent.parent


class Lab:
    def __init__(self, port: int, token: str):
        self.base = f"http://127.0.0.1:{port}"
        self.token = token

    def get(self, path: str) -> dict:
        request = urllib.request.Request(f"{self.base}{path}",
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            f"{self.base}{path}", data=json.dumps(body).encode(), method="POST",
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())


@pytest.fixture(scope="module")
def lab():
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "LAB_PORT": str(port), "JUPYTER_TOKEN": token}
    process = subprocess.Popen([str(ROOT / "scripts" / "lab")], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    server = Lab(port, token)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                server.get("/api/status")
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    os.killpg(process.pid, signal.SIGTERM)
                    pytest.fail("JupyterLab did not start:\n" + process.stdout.read()[-3000:])
                time.sleep(0.5)
        yield server
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        output = process.communicate(timeout=30)[0]
        # Headless: the URL with its token is printed for the user to open.
        assert f"http://127.0.0.1:{port}/lab?token=" in output, output[-3000:]


def execute(server: Lab, kernel_id: str, code: str) -> str:
    """Run ``code`` in a kernel over its websocket channels; its stdout (errors raise)."""
    import asyncio

    from tornado.websocket import websocket_connect

    async def run() -> str:
        url = (f"{server.base.replace('http', 'ws')}/api/kernels/{kernel_id}/channels"
               f"?token={server.token}")
        connection = await websocket_connect(url)
        msg_id = uuid.uuid4().hex
        await connection.write_message(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "test",
                       "session": uuid.uuid4().hex, "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell",
            "content": {"code": code, "silent": False, "store_history": False,
                        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True},
        }))
        stdout = []
        while True:
            raw = await asyncio.wait_for(connection.read_message(), timeout=120)
            message = json.loads(raw)
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = message["msg_type"], message["content"]
            if kind == "stream" and content["name"] == "stdout":
                stdout.append(content["text"])
            elif kind == "error":
                raise AssertionError(f"{content['ename']}: {content['evalue']}")
            elif kind == "status" and content["execution_state"] == "idle":
                connection.close()
                return "".join(stdout)

    return asyncio.run(run())


@pytest.mark.slow
def test_lab_serves_the_notebooks_and_runs_them_in_the_project_kernel(lab):
    specs = lab.get("/api/kernelspecs")["kernelspecs"]
    assert specs["gemmalab"]["spec"]["display_name"] == "Python 3.12 (gemmalab)"

    notebook = lab.get("/api/contents/train.ipynb")
    assert notebook["type"] == "notebook"
    cells = notebook["content"]["cells"]
    parameters = next(c for c in cells if "parameters" in c["metadata"].get("tags", []))

    kernel = lab.post("/api/kernels", {"name": "gemmalab"})
    output = execute(lab, kernel["id"], parameters["source"] + "\n"
                     "import sys, gemmalab.config, gemmalab.weights.resolution as r\n"
                     "config = r.resolve(gemmalab.config.TrainConfig.from_parameters(\n"
                     "    {'recipe': recipe})).config\n"
                     "print(config.model.preset, config.model.tokenizer,\n"
                     "      sys.version_info[:2] == (3, 12))")
    # The notebook's default ("": the demo recipe): the embedded pretrained Gemma 3 270M, read
    # with its own vocabulary.
    assert output.split() == ["gemma3-270m", "gemma3", "True"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="no headless Chromium here")
def test_lab_renders_the_train_notebook_in_a_browser(lab, tmp_path):
    """What a person sees: the notebook rendered by JupyterLab's own front end."""
    import matplotlib.image

    browser = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1400,900",
               "--virtual-time-budget=30000"]
    url = f"{lab.base}/lab/tree/train.ipynb?token={lab.token}"
    dom = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "Fine-tune a Gemma 3 model" in dom, dom[-2000:]
    shot = tmp_path / "lab.png"
    subprocess.run([*browser, f"--screenshot={shot}", url], capture_output=True, timeout=120,
                   check=True)
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (900, 1400) and pixels[..., :3].std() > 0.05
