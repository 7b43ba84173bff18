"""One table maps domain errors to gRPC statuses (issue 17.3): the server answers with it, the
client raises the class back from it, and kvtierctl's exit codes follow it."""

from __future__ import annotations

import inspect

import grpc
import pytest

from kvtierd import errors
from kvtierd.cli.exit_codes import ExitCode, exit_code_of
from kvtierd.server.interceptors import status_of

CLASSES = [c for _, c in inspect.getmembers(errors, inspect.isclass)
           if issubclass(c, errors.KvtierError)]  # fmt: skip


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_error_goes_over_the_wire_and_comes_back_as_itself_or_a_base(cls: type) -> None:
    error = cls("why")
    code = status_of(error)
    assert isinstance(code, grpc.StatusCode)
    back = errors.error_class(code.name)
    assert isinstance(error, back)  # a client's `except` on the class it knows still catches it


def test_the_client_raises_the_general_class_of_a_status() -> None:
    assert errors.error_class("INVALID_ARGUMENT") is errors.InvalidArgumentError  # not Config
    assert errors.error_class("UNAUTHENTICATED") is errors.UnauthenticatedError
    assert errors.error_class("INTERNAL") is errors.KvtierError
    assert errors.error_class("CANCELLED") is errors.KvtierError  # not in the table


def test_exit_codes_follow_the_status() -> None:
    assert exit_code_of(errors.NotFoundError("x")) is ExitCode.NOT_FOUND
    assert exit_code_of(errors.ConfigError("x")) is ExitCode.INVALID
    assert exit_code_of(errors.StorageFullError("x")) is ExitCode.BUSY  # a CapacityError
    assert exit_code_of(errors.UnauthenticatedError("x")) is ExitCode.DENIED
    assert exit_code_of(errors.CorruptObjectError("x")) is ExitCode.ERROR
    assert exit_code_of(errors.SolverError("x")) is ExitCode.ERROR  # INTERNAL
