"""The names OLMo-core's io module subclasses or registers at import time."""


class SchemeClient:
    recoverable_errors: tuple = ()

    def __init__(self, resource: str) -> None:
        self.resource = resource


class S3Client(SchemeClient):
    pass


def add_scheme_client(client) -> None:
    raise RuntimeError("cached_path stand-in (tests/stand_ins): no scheme client can be registered in these tests")
