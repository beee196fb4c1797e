"""Every Redis key name the service uses, in one place, so the wire format has a single source of truth.

On Redis Cluster every key carries the hash tag `{<prefix>}` (`{specserve}:requests`, `{specserve}:req:<id>`):
the scripts of queue/scripts.py and queue/ready.py each touch a request's keys together with the request
stream, the ready queue and its tenant's counters, and Cluster runs a script only when all its keys share one
slot. On a single instance the names stay untagged (`specserve:requests`), as producers already use them.

With `--queue-shards N` (N > 1) the request stream is N streams, and everything a script touches beside it
moves with it: shard k's keys start with `{<prefix>:s<k>}` on a cluster (`<prefix>:s<k>` on a single
instance), its stream, group, dead letters, ready queue, routing keys, reply streams and the status hash and
output stream of every request whose id hashes to it (`shard_of`). So each script call stays in one slot,
and the shards' slots spread over the cluster's masters. A request's keys follow its shard rather than a
`{<id>}` tag because every script that touches them (CLAIM, FINISH, APPEND, HANDBACK, SORT_IN, PASS) touches
the shard's stream too. What belongs to the fleet (served models, the API-keys mark, the shard count, the
Batch API) keeps the shard-less names. Tenant quotas: see `quota` and `tenant_quota`.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, replace

DEFAULT_PREFIX = "specserve"
DEFAULT_TTL_MS = 24 * 3600 * 1000  # how long every per-request key lives

# Ids end up inside key names and log lines: keep them short and free of spaces and glob characters.
_REQUEST_ID = re.compile(r"^[A-Za-z0-9_.:\-]{1,200}$")


def valid_request_id(request_id: object) -> bool:
    return isinstance(request_id, str) and bool(_REQUEST_ID.match(request_id))


def shard_of(request_id: str, shards: int) -> int:
    """The shard a request belongs to: CRC-32 (IEEE, as zlib and every language's standard library compute
    it) of the id's UTF-8 bytes, modulo the shard count. Producers that XADD themselves use the same rule."""
    return zlib.crc32(request_id.encode("utf-8", "surrogateescape")) % shards if shards > 1 else 0


@dataclass(frozen=True)
class Keys:
    prefix: str = DEFAULT_PREFIX
    cluster: bool = False  # the server is a Redis Cluster: every key in the one slot of `{prefix}`
    shards: int = 1  # request streams of the fleet (--queue-shards)
    shard: int = 0  # the shard these names are of (fleet-wide names ignore it)

    @property
    def fleet_base(self) -> str:
        """What the fleet's own key names start with: the prefix, hash-tagged on a cluster."""
        return f"{{{self.prefix}}}" if self.cluster else self.prefix

    @property
    def base(self) -> str:
        """What a shard's key names start with: the fleet's base while there is one shard."""
        if self.shards <= 1:
            return self.fleet_base
        tag = f"{self.prefix}:s{self.shard}"
        return f"{{{tag}}}" if self.cluster else tag

    def of_shard(self, shard: int) -> Keys:
        return self if shard == self.shard else replace(self, shard=shard)

    def of_request(self, request_id: str) -> Keys:
        """The names of the shard `request_id` belongs to (its status, output, stream and group)."""
        return self.of_shard(shard_of(request_id, self.shards))

    def every_shard(self) -> list[Keys]:
        return [self.of_shard(k) for k in range(max(1, self.shards))]

    @property
    def config(self) -> str:
        """Hash: settings every process of the fleet must share (queue_shards), set by the first to start."""
        return f"{self.fleet_base}:config"

    @property
    def requests(self) -> str:
        """The request stream producers XADD to."""
        return f"{self.base}:requests"

    @property
    def group(self) -> str:
        """The consumer group every worker reads the request stream with."""
        return f"{self.base}:workers"

    @property
    def dead(self) -> str:
        """Dead letters: requests delivered too many times."""
        return f"{self.base}:dead"

    @property
    def models(self) -> str:
        """Hash: served model name -> JSON info refreshed by live workers."""
        return f"{self.fleet_base}:models"

    @property
    def keyed(self) -> str:
        """String: set by an API with keys, so that one without keys does not serve their tenants' requests
        to anyone unless told to."""
        return f"{self.fleet_base}:keyed"

    def req(self, request_id: str) -> str:
        """Status hash of one request."""
        return f"{self.base}:req:{request_id}"

    def out(self, request_id: str) -> str:
        """Output stream of one request."""
        return f"{self.base}:out:{request_id}"

    @property
    def split_quota(self) -> bool:
        """Tenant counters live apart from the shards (queue/tenants.py): a cluster with several shards, where
        no one slot holds every shard's stream and a tenant's counters together."""
        return self.cluster and self.shards > 1

    @property
    def quota(self) -> str:
        """Prefix of the admission-limit keys the shard scripts count in: quota:queued:<tenant> (a sorted set
        of request ids) and quota:tpm:<tenant>:<minute> (tokens asked for in that minute).

        Fleet-wide wherever a script may reach them: one set of keys under the fleet's base, so a tenant's
        limits hold across every shard. Empty where the counters are split off (`split_quota`): the shard
        scripts then count nothing, and queue/tenants.py keeps each tenant's under `tenant_quota`."""
        if self.split_quota:
            return ""
        return f"{self.base if self.cluster else self.fleet_base}:quota:"

    def tenant_quota(self, tenant: str) -> str:
        """The quota prefix one tenant's counters use: its own slot (`{<prefix>:t:<tenant>}`) where they are
        split off the shards, else `quota`."""
        if not self.split_quota:
            return self.quota
        return f"{{{self.prefix}:t:{tenant}}}:quota:"

    def reply(self, name: str) -> str:
        """A producer's reply stream: the final results (and, if asked, deltas) of the requests naming it."""
        return f"{self.base}:reply:{name}"

    def warm(self, route_key: str) -> str:
        """Sorted set: the workers that recently started a request with this routing key (queue/routing.py),
        scored by when that stops counting."""
        return f"{self.base}:warm:{route_key}"

    @property
    def load(self) -> str:
        """Hash: worker -> "in-flight free-room server-ms", refreshed by workers that route by prefix."""
        return f"{self.base}:load"

    def passes(self, worker: str) -> str:
        """Stream of the entries other workers passed to this one (queue/routing.py)."""
        return f"{self.base}:pass:{worker}"

    def wake(self, reader_id: str) -> str:
        """Private stream an output reader blocks on alongside its output streams, to be woken up."""
        return f"{self.base}:wake:{reader_id}"

    def suffix_outputs(self, model: str) -> str:
        """Stream of the finished outputs' token ids of the workers serving `model`, which each one's suffix
        tree learns from (service/suffix_fleet.py), trimmed to about SUFFIX_FLEET_MAXLEN entries."""
        return f"{self.base}:suffix:{model}"

    @property
    def ready(self) -> str:
        """Prefix of the ready queue's keys (queue/ready.py)."""
        return f"{self.base}:ready:"

    def batch(self, kind: str, name: str) -> str:
        """The batch API's keys: file:<id>, files:<tenant>, batch:<id>, batches:<tenant>."""
        return f"{self.fleet_base}:{kind}:{name}"
