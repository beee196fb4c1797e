"""Every Redis key name the service uses, in one place, so the wire format has a single source of truth."""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_PREFIX = "specserve"
DEFAULT_TTL_MS = 24 * 3600 * 1000  # how long every per-request key lives

# Ids end up inside key names and log lines: keep them short and free of spaces and glob characters.
_REQUEST_ID = re.compile(r"^[A-Za-z0-9_.:\-]{1,200}$")


def valid_request_id(request_id: object) -> bool:
    return isinstance(request_id, str) and bool(_REQUEST_ID.match(request_id))


@dataclass(frozen=True)
class Keys:
    prefix: str = DEFAULT_PREFIX

    @property
    def requests(self) -> str:
        """The request stream producers XADD to."""
        return f"{self.prefix}:requests"

    @property
    def group(self) -> str:
        """The consumer group every worker reads the request stream with."""
        return f"{self.prefix}:workers"

    @property
    def dead(self) -> str:
        """Dead letters: requests delivered too many times."""
        return f"{self.prefix}:dead"

    @property
    def models(self) -> str:
        """Hash: served model name -> JSON info refreshed by live workers."""
        return f"{self.prefix}:models"

    @property
    def keyed(self) -> str:
        """String: set by an API with keys, so that one without keys does not serve their tenants' requests
        to anyone unless told to."""
        return f"{self.prefix}:keyed"

    def req(self, request_id: str) -> str:
        """Status hash of one request."""
        return f"{self.prefix}:req:{request_id}"

    def out(self, request_id: str) -> str:
        """Output stream of one request."""
        return f"{self.prefix}:out:{request_id}"

    @property
    def quota(self) -> str:
        """Prefix of the admission-limit keys: quota:queued:<tenant> (a sorted set of request ids) and
        quota:tpm:<tenant>:<minute> (tokens asked for in that minute)."""
        return f"{self.prefix}:quota:"

    def reply(self, name: str) -> str:
        """A producer's reply stream: the final results (and, if asked, deltas) of the requests naming it."""
        return f"{self.prefix}:reply:{name}"

    def warm(self, route_key: str) -> str:
        """Sorted set: the workers that recently started a request with this routing key (queue/routing.py),
        scored by when that stops counting."""
        return f"{self.prefix}:warm:{route_key}"

    @property
    def load(self) -> str:
        """Hash: worker -> "in-flight free-room server-ms", refreshed by workers that route by prefix."""
        return f"{self.prefix}:load"

    def passes(self, worker: str) -> str:
        """Stream of the entries other workers passed to this one (queue/routing.py)."""
        return f"{self.prefix}:pass:{worker}"

    def wake(self, reader_id: str) -> str:
        """Private stream an output reader blocks on alongside its output streams, to be woken up."""
        return f"{self.prefix}:wake:{reader_id}"
