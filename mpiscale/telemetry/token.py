"""A job's control token: what a command must carry for the job to obey it.

On a broker without ACLs anyone who can publish to ``mpiscale/<job>/control``
could stop any job. So rank 0 of a job that listens for commands makes a
random token at its start and writes it to ``~/.mpiscale/jobs/<job>.token``
(``MPISCALE_TOKEN_DIR`` names another directory), readable by its user only;
``mpiscale control`` reads it there (home directories are shared across a
cluster's nodes) and puts it in the command. ``MPISCALE_CONTROL_TOKEN`` set
for the job chooses the token instead (for a controlling host that does not
share the job's home); set for ``mpiscale control``, it is the one sent.
"""

from __future__ import annotations

import hmac
import os
import secrets
import tempfile
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote

TOKEN_VARIABLE = "MPISCALE_CONTROL_TOKEN"
DIRECTORY_VARIABLE = "MPISCALE_TOKEN_DIR"


def token_path(job: str, environ: Mapping[str, str] | None = None) -> Path:
    """Where ``job``'s token is kept (the job id quoted: ids may hold slashes)."""
    env = os.environ if environ is None else environ
    directory = Path(env.get(DIRECTORY_VARIABLE) or Path.home() / ".mpiscale" / "jobs")
    return directory / f"{quote(job, safe='')}.token"


def issue(job: str, environ: Mapping[str, str] | None = None) -> str:
    """The job's token (``MPISCALE_CONTROL_TOKEN``, else a new random one), written to :func:`token_path` with mode
    0600; OSError when it cannot be written (the caller says so: commands are then refused)."""
    env = os.environ if environ is None else environ
    token = env.get(TOKEN_VARIABLE) or secrets.token_urlsafe(24)
    path = token_path(job, env)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=".token-")  # created 0600
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(token + "\n")
        os.replace(temporary, path)  # a requeued run of the job takes over its file
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return token


def read(job: str, environ: Mapping[str, str] | None = None) -> str:
    """The token to send to ``job``: ``MPISCALE_CONTROL_TOKEN``, else its file; OSError naming the file if absent."""
    env = os.environ if environ is None else environ
    if env.get(TOKEN_VARIABLE):
        return env[TOKEN_VARIABLE]
    return token_path(job, env).read_text().strip()


def matches(given: object, token: str | None) -> bool:
    """Whether a command's ``token`` field is the job's (in constant time); never when the job has none."""
    return token is not None and isinstance(given, str) and hmac.compare_digest(given.encode(), token.encode())
