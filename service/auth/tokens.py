"""Bearer tokens: generated with `secrets`, stored only as SHA-256, compared in constant time.

Tokens carry 256 bits of randomness, so an unsalted SHA-256 is a safe lookup key: there is
nothing to brute-force. The admin token comes from settings or is generated once into
``$TORCHJOBS_HOME/admin.token`` with mode 0600.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from service.config import Settings
from service.errors import Unauthorized
from service.models import User
from service.users import repository as users_repo

if TYPE_CHECKING:  # a type only: the job service imports this module without FastAPI
    from fastapi.security import HTTPAuthorizationCredentials

ADMIN_NAME = "admin"
MAX_TOKEN_CHARS = 512


def presented_token(creds: HTTPAuthorizationCredentials | None) -> str:
    """The bearer token of a request, or 401 before anything is looked up."""
    if creds is None or not creds.credentials or len(creds.credentials) > MAX_TOKEN_CHARS:
        raise Unauthorized()
    return creds.credentials


def new_token() -> str:
    return "tj_" + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def tokens_match(token_hash: str, expected_hash: str) -> bool:
    return hmac.compare_digest(token_hash, expected_hash)


def read_or_create_admin_token(settings: Settings) -> str:
    if settings.admin_token:
        return settings.admin_token
    path = settings.admin_token_file
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = new_token()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    return token


def ensure_admin(session: Session, settings: Settings) -> None:
    """Make the `admin` user row match the configured admin token (it owns the admin's jobs)."""
    token_hash = hash_token(read_or_create_admin_token(settings))
    admin = users_repo.by_name(session, ADMIN_NAME)
    if admin is None:
        users_repo.add(session, User(name=ADMIN_NAME, token_hash=token_hash, is_admin=True))
    elif admin.token_hash != token_hash or not admin.is_admin:
        admin.token_hash = token_hash
        admin.is_admin = True


def user_for_token(session: Session, token: str) -> User | None:
    return user_for_token_hash(session, hash_token(token))


def user_for_token_hash(session: Session, token_hash: str) -> User | None:
    user = users_repo.by_token_hash(session, token_hash)
    if user is None or user.token_hash is None or not tokens_match(user.token_hash, token_hash):
        return None
    return user
