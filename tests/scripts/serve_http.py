"""A job that serves its own folder over HTTP on 127.0.0.1:PORT (Python's http.server), as a
job serving TensorBoard or a notebook would, until it is cancelled
(tests/integration/test_exec.py reaches it through `torchjobs forward`)."""

import functools
import http.server
import os
import sys
from pathlib import Path

port = int(sys.argv[1])
here = Path(os.environ.get("TORCHJOBS_WORKDIR") or ".")
(here / "hello.txt").write_text(f"served by job {os.environ['TORCHJOBS_JOB_ID']}\n")
handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(here))
http.server.ThreadingHTTPServer(("127.0.0.1", port), handler).serve_forever()
