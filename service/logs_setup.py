"""Server and worker logging: human lines by default, one JSON object per line when asked
(`TORCHJOBS_LOG_JSON=1`), with the job id on every record that concerns a job."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from service.config import Settings


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        job_id = getattr(record, "job_id", None)
        if job_id is None and record.args and isinstance(record.args, tuple) and "job %s" in str(record.msg):
            job_id = record.args[0]
        if job_id is not None:
            out["job_id"] = job_id
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


LINE = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(settings: Settings, log_file: Path | None = None) -> None:
    """To stderr; with `log_file`, every line of the process (ours, uvicorn's, Python's
    warnings) to that file instead, and only errors to the terminal (`torchjobs up`)."""
    if log_file is not None:
        _to_file(settings, log_file)
        return
    handler = logging.StreamHandler(sys.stderr)
    ours = logging.getLogger("torchjobs")
    ours.setLevel(logging.INFO)
    if settings.log_json:
        # Every line of the process is JSON: ours, uvicorn's and Celery's all go to the root.
        handler.setFormatter(JsonFormatter())
        root = logging.getLogger()
        root.handlers[:] = [handler]
        root.setLevel(logging.WARNING)
        ours.handlers[:] = []
        ours.propagate = True
        logging.captureWarnings(True)  # Python warnings become JSON lines too
        return
    handler.setFormatter(logging.Formatter(LINE))
    ours.handlers[:] = [handler]
    ours.propagate = False


def _to_file(settings: Settings, path: Path) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    to_file = logging.FileHandler(path)
    to_file.setFormatter(JsonFormatter() if settings.log_json else logging.Formatter(LINE))
    to_terminal = logging.StreamHandler(sys.stderr)
    to_terminal.setLevel(logging.ERROR)
    to_terminal.setFormatter(logging.Formatter(f"%(levelname)s %(name)s: %(message)s (more in {path})"))
    root = logging.getLogger()
    root.handlers[:] = [to_file, to_terminal]
    root.setLevel(logging.WARNING)
    ours = logging.getLogger("torchjobs")
    ours.setLevel(logging.INFO)
    ours.handlers[:] = []
    ours.propagate = True
    logging.captureWarnings(True)
