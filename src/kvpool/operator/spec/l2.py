"""A pool's L2 (``spec.l2``): the tiers behind L1 and the keys of their objects."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import ConfigDict, Field, model_validator

from kvpool.operator.spec.base import PositiveBytes, SecretRef, SpecModel
from kvpool.operator.spec.markers import ATOMIC, Rule, cel

S3_NEEDS_KEY = (
    "an s3 tier needs spec.l2.encryption.keySecretRef: every agent of the pool seals or "
    "authenticates its objects with that key (a key per node would make other nodes' objects "
    "misses)"
)
NVME_ENCRYPTION_NEEDS_KEY = (
    "an nvme tier with encryption needs spec.l2.encryption.keySecretRef: a key kept on the "
    "disk beside the data protects nothing at rest"
)
SSE_KMS_KEY_NEEDS_KMS = "s3.sseKmsKeyId needs s3.serverSideEncryption aws:kms or aws:kms:dsse"
"""Also refused by the agent's configuration, in its own words."""


class NvmeTier(SpecModel):
    host_path: str = Field(
        json_schema_extra={"pattern": "^/.*", "maxLength": 4096},
        description="Directory on the node (created if missing, and given to the agent's user); "
        "the agent keeps its files under <hostPath>/<pool>.",
    )
    capacity: PositiveBytes = Field(description="Bytes the agent may use in hostPath.")
    encryption: bool = Field(
        False,
        description="Seal each file with AES-GCM under the pool's key (needs "
        "spec.l2.encryption.keySecretRef). Off: files are plaintext, still authenticated with "
        "the key (a forged or renamed file is a miss). Off by default: the disk is the node's "
        "own, as its memory is.",
    )


class S3Tier(SpecModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                "!has(self.sseKmsKeyId) || (has(self.serverSideEncryption) && "
                "self.serverSideEncryption.startsWith('aws:kms'))",
                SSE_KMS_KEY_NEEDS_KMS,
            )
        )
    )

    bucket: str = Field(
        description="Bucket name.", json_schema_extra={"minLength": 3, "maxLength": 63}
    )
    prefix: str = Field(
        "kvpool",
        json_schema_extra={"maxLength": 512},
        description="Key prefix: objects go under <prefix>/<pool>/<tenant>/.",
    )
    endpoint: str | None = Field(
        None,
        json_schema_extra={"maxLength": 2048},
        description="Endpoint URL for S3-compatible stores; absent means AWS.",
    )
    region: str | None = Field(
        None, description="Region of the bucket.", json_schema_extra={"maxLength": 64}
    )
    credentials_secret_ref: SecretRef | None = Field(
        None,
        description="Secret whose keys become the agent's environment (AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, ...). Absent: the node's or service account's own credentials.",
    )
    encryption: bool = Field(
        True,
        description="Seal each object with AES-GCM under the pool's key. Off: objects are "
        "plaintext, still authenticated with the key (a forged or renamed object is a miss). "
        "On by default: whoever can read the bucket or sit on an http endpoint would read "
        "every tenant's KV, which is their prompts in another form.",
    )
    server_side_encryption: Literal["AES256", "aws:kms", "aws:kms:dsse"] | None = Field(
        None,
        description="S3 server-side encryption asked for on every put, for buckets whose "
        "policy requires it; independent of encryption.",
    )
    sse_kms_key_id: str | None = Field(
        None,
        json_schema_extra={"minLength": 1, "maxLength": 2048},
        description="KMS key (id, ARN or alias) of serverSideEncryption aws:kms or "
        "aws:kms:dsse; absent: the bucket's default KMS key.",
    )


class L2Tier(SpecModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                "self.type == 'nvme' ? has(self.nvme) && !has(self.s3) "
                ": has(self.s3) && !has(self.nvme)",
                message_expression="'an L2 tier of type ' + self.type + ' sets the field ' + "
                "self.type + ' and no other'",
            )
        )
    )

    type: Literal["nvme", "s3"] = Field(
        description="Kind of tier; the field of the same name configures it."
    )
    nvme: NvmeTier | None = Field(
        None, description="Files on a local disk of each node (kept across agent restarts)."
    )
    s3: S3Tier | None = Field(None, description="An S3 bucket shared by every agent of the pool.")

    @model_validator(mode="after")
    def _one_member(self) -> Self:
        members = {"nvme": self.nvme, "s3": self.s3}
        if members[self.type] is None or any(
            value is not None for name, value in members.items() if name != self.type
        ):
            raise ValueError(f"an L2 tier of type {self.type} sets the field {self.type} only")
        return self


class L2EncryptionSpec(SpecModel):
    key_secret_ref: SecretRef | None = Field(
        None,
        description="Secret whose entries are the master keys: each entry's name is a key id "
        '("1", "2", ...), its value the key (at least 32 bytes, e.g. openssl rand -hex 32). The '
        "highest id seals new objects; every id present opens old ones. Mounted into the "
        "agents, which reread it: a change needs no restart. Required with an s3 tier or an "
        "encrypted nvme tier. Absent: each agent keeps a key of its own under the nvme tier's "
        "hostPath.",
    )


class L2Spec(SpecModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            Rule(
                "!has(self.tiers) || !self.tiers.exists(t, t.type == 's3') || "
                "(has(self.encryption) && has(self.encryption.keySecretRef))",
                S3_NEEDS_KEY,
            ),
            Rule(
                "!has(self.tiers) || !self.tiers.exists(t, t.type == 'nvme' && has(t.nvme) && "
                "has(t.nvme.encryption) && t.nvme.encryption) || "
                "(has(self.encryption) && has(self.encryption.keySecretRef))",
                NVME_ENCRYPTION_NEEDS_KEY,
            ),
        )
    )

    store_policy: Literal["all", "reused"] = Field(
        "all",
        description="Which chunks are written back to the L2 tiers (in the background): all "
        "committed chunks, or those hit at least storeMinHits times.",
    )
    store_min_hits: int = Field(
        1,
        ge=1,
        json_schema_extra={"maximum": 1_000_000},
        description="Hits before a chunk is written back when storePolicy is reused.",
    )
    tiers: tuple[L2Tier, ...] = Field(
        (),
        description="At most one tier of each type, in lookup order.",
        json_schema_extra={"maxItems": 2}
        | ATOMIC
        | cel(
            Rule(
                "self.filter(t, t.type == 'nvme').size() <= 1 && "
                "self.filter(t, t.type == 's3').size() <= 1",
                "l2.tiers may hold at most one tier of each type (nvme, s3)",
            )
        ),
    )
    encryption: L2EncryptionSpec = Field(
        default_factory=L2EncryptionSpec,
        description="The master keys that seal (AES-GCM) or authenticate every L2 object of "
        "the pool, with a key per tenant derived from them. An object forged or copied under "
        "another chunk key without them is a miss.",
    )

    @model_validator(mode="after")
    def _shared_tiers_have_the_pools_key(self) -> Self:
        if self.encryption.key_secret_ref is None:
            s3, nvme = self.tier("s3"), self.tier("nvme")
            if s3 is not None:
                raise ValueError(S3_NEEDS_KEY)
            if nvme is not None and nvme.nvme is not None and nvme.nvme.encryption:
                raise ValueError(NVME_ENCRYPTION_NEEDS_KEY)
        return self

    def tier(self, kind: Literal["nvme", "s3"]) -> L2Tier | None:
        return next((tier for tier in self.tiers if tier.type == kind), None)
