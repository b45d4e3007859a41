"""A peer's identity: the RSA key behind its libp2p peer id, which also signs its DHT records.

libp2p authenticates the peer id of every stream: it is the hash of the peer's public key. The DHT
records a peer writes (its announcement, its gone reports, a run's manifest) are signed with the
same key through hivemind's `RSASignatureValidator`: a record whose subkey carries an owner mark
`[owner:<public key>]` is accepted by a DHT node (on store) and by a reader (on every answer) only
with its owner's signature. A reader then maps the mark's key to a peer id (`owner_of`) and
trusts a record only if the peer it speaks for is that owner: nobody can write, overwrite or
forge another peer's records, and a self-declared name in a record counts for nothing.

Every peer therefore holds its private key: `--identity` names a file (hivemind's format, created
if missing), and without one `identity_file` makes a fresh key in a private temporary directory
that lives only until the daemon has read it.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import base58
import multihash
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from google.protobuf.message import DecodeError
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

# "<what>[owner:<ssh-rsa public key>]": the owner mark hivemind's validator looks for, at the end
_OWNED = re.compile(r"^(?P<base>.*)\[owner:(?P<key>[^\]]+)\]$", re.DOTALL)


class IdentityError(ValueError):
    """An identity file that is not a libp2p RSA private key."""


@dataclass(frozen=True)
class Identity:
    """This peer's private key and the peer id it proves."""

    key: RSAPrivateKey
    peer_id: str

    @property
    def mark(self) -> str:
        """The owner mark that ends the subkey of every record this peer writes."""
        return f"[owner:{self.key.get_public_key().to_bytes().decode()}]"

    def validator(self) -> RSASignatureValidator:
        """hivemind's record validator signing with this key (and checking everyone's)."""
        return RSASignatureValidator(self.key)

    def owned(self, base: str) -> str:
        """`base` as a subkey that only this peer may write."""
        return base + self.mark

    def seal(self, record: bytes) -> tuple[bytes, bytes]:
        """(our public key in ssh form, our signature of `record`): what `signer_of` checks."""
        return self.key.get_public_key().to_bytes(), base64.b64decode(self.key.sign(record))


def signer_of(record: bytes, key: bytes, signature: bytes) -> str | None:
    """The peer id of `key` if `signature` is its signature of `record`; None if it is not, or
    `key` is not an RSA public key in ssh form."""
    try:
        public = RSAPublicKey.from_bytes(key)
    except (ValueError, TypeError, UnicodeError, UnsupportedAlgorithm):
        return None
    if not public.verify(record, base64.b64encode(signature)):
        return None
    return _peer_id_of_text(key.decode())


def generate(path: str | Path) -> None:
    """Write a new private key to `path` in hivemind's format (an RSA key, as hivemind makes)."""
    P2P.generate_identity(str(path))


def fresh() -> Identity:
    """A new identity held in memory only, of the kind `generate` writes (tests and benches that
    need signed records and keep nothing)."""
    key = RSAPrivateKey()
    return Identity(key, peer_id_of(key.get_public_key()))


def load(path: str | Path) -> Identity:
    """The identity in `path`; IdentityError if it is not an RSA key in hivemind's format."""
    try:
        proto = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes())
        if proto.key_type != crypto_pb2.RSA:
            kind = crypto_pb2.KeyType.Name(proto.key_type)
            raise IdentityError(
                f"{path} holds an {kind} key; noloco needs RSA: move it away to get a new one"
            )
        private = serialization.load_der_private_key(proto.data, password=None)
    except (OSError, ValueError, TypeError, DecodeError, UnsupportedAlgorithm) as e:
        if isinstance(e, IdentityError):
            raise
        raise IdentityError(f"{path} is not a libp2p private key ({e}); move it away to get a new one") from e
    if not isinstance(private, rsa.RSAPrivateKey):
        raise IdentityError(f"{path} holds no RSA key; noloco needs RSA: move it away to get a new one")
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": proto.data})  # hivemind's own way to rebuild one from DER
    return Identity(key, peer_id_of(key.get_public_key()))


def peer_id_of(public_key: RSAPublicKey) -> str:
    """The libp2p peer id of an RSA public key: the sha2-256 multihash of its protobuf form."""
    der = serialization.load_ssh_public_key(public_key.to_bytes()).public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


def owner_of(subkey: object) -> tuple[str, str] | None:
    """(the part before the owner mark, the owner's peer id) of a subkey, or None if it has no
    well-formed mark. Only the mark's owner can have written a record stored under the subkey:
    the DHT checked its signature."""
    if not isinstance(subkey, str):
        return None
    found = _OWNED.match(subkey)
    if found is None:
        return None
    peer = _peer_id_of_text(found["key"])
    return None if peer is None else (found["base"], peer)


@functools.lru_cache(maxsize=1024)
def _peer_id_of_text(text: str) -> str | None:
    try:
        return peer_id_of(RSAPublicKey.from_bytes(text.encode()))
    except (ValueError, TypeError, UnicodeError, UnsupportedAlgorithm):  # the key is a stranger's text
        return None


@contextlib.contextmanager
def identity_file(path: str | None) -> Iterator[tuple[str, bool]]:
    """(the identity file to start the daemon with, whether it is a fresh key made here).

    With `path`, that file (created first if missing: then fresh). Without, a fresh key in a private temporary
    directory, removed when the block ends: start the daemon inside the block and load the key
    there. A fresh key cannot be in use elsewhere, so the daemon need not check."""
    if path is not None:
        created = not os.path.exists(path)
        if created:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            generate(path)
        yield path, created
        return
    folder = tempfile.mkdtemp(prefix="noloco-identity-")
    try:
        fresh = os.path.join(folder, "identity.key")
        generate(fresh)
        yield fresh, True
    finally:
        shutil.rmtree(folder, ignore_errors=True)
