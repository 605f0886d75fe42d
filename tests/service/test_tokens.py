"""Tokens: generated with 256 bits, stored as a hash only, the admin's file private."""

from __future__ import annotations

import stat
from pathlib import Path

from sqlalchemy import select

from service.auth.tokens import ensure_admin, hash_token, read_or_create_admin_token, user_for_token
from service.config import Settings
from service.db import Database
from service.migrate import upgrade
from service.models import User


def test_admin_token_is_generated_once_into_a_private_file(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, admin_token=None)
    token = read_or_create_admin_token(settings)
    mode = stat.S_IMODE(settings.admin_token_file.stat().st_mode)
    assert mode == 0o600
    assert len(token) > 40 and read_or_create_admin_token(settings) == token


def test_only_the_hash_is_stored_and_revocation_is_immediate(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, admin_token="tj_admin_for_this_test")
    upgrade(settings)
    db = Database(settings)
    with db.transaction() as session:
        ensure_admin(session, settings)
    with db.transaction() as session:
        admin = session.execute(select(User).where(User.name == "admin")).scalar_one()
        assert admin.token_hash == hash_token("tj_admin_for_this_test")
        assert "tj_admin_for_this_test" not in repr(admin.__dict__)
        assert user_for_token(session, "tj_admin_for_this_test").is_admin
        admin.token_hash = None
    with db.transaction() as session:
        assert user_for_token(session, "tj_admin_for_this_test") is None
    db.dispose()
