"""Where a run's files live: a local directory or a Google Cloud Storage bucket (`gs://`).

The one place that knows the difference: which URLs jdp accepts, how every GCS client in
the process (tensorstore under Orbax, gcsfs under etils.epath and TFDS, google-cloud-storage
under tensorboardX) is pointed at an emulator by `STORAGE_EMULATOR_HOST` alone, the check
at start that a workdir can be written, the few file operations the workdir needs on
both (open, exists, list, remove), and the local directories files for a bucket are
written to first.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import re
import tempfile
import uuid
from collections.abc import MutableMapping
from typing import IO

from jdp.errors import ConfigError, first_line
from jdp.runtime import leftovers

BUCKET_PREFIX = "gs://"
EMULATOR_VARIABLE = "STORAGE_EMULATOR_HOST"  # google-cloud-storage's convention
_ALTERNATIVES = ("a gs://BUCKET/PATH workdir, or a path on a mounted file system "
                 "(gcsfuse, mountpoint-s3, NFS)")
_INSTALL = "pip install 'jdp[gcs]'"


def is_bucket(path: str | os.PathLike) -> bool:
    return os.fspath(path).startswith(BUCKET_PREFIX)


def check_supported(path: str, field: str) -> None:
    """Raises ConfigError for a URL jdp cannot use (anything but gs://), before anything
    is written: orbax-checkpoint 0.12 builds tensorstore specs for gs:// only and would
    save an s3:// path into a local directory named `s3:`."""
    scheme, separator, _ = path.partition("://")
    if separator and f"{scheme}://" != BUCKET_PREFIX:
        raise ConfigError(
            f"{field}={path!r}: {scheme}:// paths are not supported (jdp reads and writes "
            "gs:// buckets and local paths only: Orbax 0.12 saves checkpoints to gs:// alone). "
            f"Fix: use {_ALTERNATIVES}.")
    if is_bucket(path) and not _bucket_name(path):
        raise ConfigError(f"{field}={path!r} names no bucket. Fix: use gs://BUCKET/PATH.")


def configure(environ: MutableMapping[str, str] = os.environ) -> None:
    """Sets up this process's GCS clients: gcsfs lists afresh every time (the processes
    of a job write one workdir, so a cached listing would miss another's objects), and
    with $STORAGE_EMULATOR_HOST set every client goes to that endpoint and nowhere else.
    The user's own settings of these variables win; the processes jdp starts inherit them.

    Call before the clients are imported or first used: gcsfs reads its variable at import,
    google-auth at import, tensorstore at its first gs:// open.
    """
    endpoint = environ.get(EMULATOR_VARIABLE, "")
    if endpoint not in ("", "default"):
        _use_emulator(environ, endpoint if "://" in endpoint else f"http://{endpoint}")
    try:
        import fsspec
    except ImportError:  # without the gcs extra; check_writable says what to install
        return
    options = fsspec.config.conf.setdefault("gs", {})
    options.setdefault("use_listings_cache", False)
    if endpoint not in ("", "default"):
        options.setdefault("token", "anon")  # the emulator takes no credentials


def _use_emulator(environ: MutableMapping[str, str], endpoint: str) -> None:
    # tensorstore has its own variable for the endpoint, and would otherwise look for
    # credentials and ask metadata.google.internal; a fixed test token asks nobody.
    environ.setdefault("TENSORSTORE_GCS_HTTP_URL", endpoint)
    environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    # google-auth (under google-cloud-storage and gcsfs) probes the GCE metadata server.
    environ.setdefault("NO_GCE_CHECK", "true")
    # gcsfs's zonal/HNS bucket support asks the endpoint over gRPC first, which an
    # emulator does not answer: 60 s per bucket before it falls back.
    environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    # With TensorFlow installed, epath would use tf.io.gfile, which knows no emulator.
    environ.setdefault("EPATH_USE_TF", "false")


def check_writable(workdir: str, field: str = "--workdir") -> None:
    """Raises ConfigError (one line: the path and the fix) unless this process can write
    into bucket workdir `workdir`: the bucket must exist and the credentials allow it.

    Writes and deletes one probe object; several processes may probe at once.
    """
    bucket = _bucket_name(workdir)
    try:
        fs = _filesystem()
    except ImportError as e:
        raise ConfigError(f"{field}={workdir!r}: gs:// paths need gcsfs ({first_line(e)}). "
                          f"Fix: {_INSTALL}.") from e
    probe = f"{workdir.rstrip('/')}/.jdp_write_test_{uuid.uuid4().hex}"
    try:
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
    except FileNotFoundError as e:
        if not _exists(fs, bucket):
            raise ConfigError(
                f"{field}={workdir!r}: bucket {bucket!r} does not exist. Fix: create it "
                f"(gcloud storage buckets create gs://{bucket}) or name an existing one"
                + _emulator_hint()) from e
        raise _unwritable(field, workdir, e) from e
    except Exception as e:  # noqa: BLE001 - gcsfs raises HttpError, OSError and auth errors
        if getattr(e, "code", None) in (401, 403) or "credentials" in str(e).lower():
            raise ConfigError(
                f"{field}={workdir!r}: no permission to write there ({first_line(e)}). Fix: "
                "give this machine credentials that may write to the bucket (`gcloud auth "
                "application-default login`, or GOOGLE_APPLICATION_CREDENTIALS=KEY.json)"
            ) from e
        raise _unwritable(field, workdir, e) from e


def _unwritable(field: str, workdir: str, error: Exception) -> ConfigError:
    return ConfigError(f"{field}={workdir!r} cannot be written ({type(error).__name__}: "
                       f"{first_line(error)}). Fix: choose a gs://BUCKET/PATH you can write to "
                       "(object names of at most 1024 bytes)")


def _emulator_hint() -> str:
    endpoint = os.environ.get(EMULATOR_VARIABLE)
    return f" (on the emulator at {endpoint})" if endpoint else ""


def _bucket_name(path: str) -> str:
    return path[len(BUCKET_PREFIX):].split("/", 1)[0]


def _filesystem():
    import fsspec
    import gcsfs  # noqa: F401 - fails here, with its reason, when the gcs extra is missing

    return fsspec.filesystem("gs")


def _exists(fs, path: str) -> bool:
    try:
        return fs.exists(path)
    except Exception:  # noqa: BLE001 - unreachable or forbidden: not known to exist
        return False


# -- File operations on both ---------------------------------------------------------------

def absolute(path: str | os.PathLike) -> str:
    """A local path made absolute; a bucket URL as it is (`os.path.abspath` would turn
    `gs://b/r` into `<cwd>/gs:/b/r`)."""
    path = os.fspath(path)
    return path if is_bucket(path) else os.path.abspath(path)


def join(path: str, *names: str) -> str:
    return os.path.join(path, *names)  # posix joins keep gs://; named for the readers


def open_file(path: str, mode: str = "r") -> IO:
    """`open` for local paths, etils.epath (gcsfs) for buckets. A bucket object written with
    "w" appears whole at close; "a" is refused, since gcsfs would silently overwrite."""
    if not is_bucket(path):
        return builtins.open(path, mode)
    if "a" in mode:
        raise ValueError(f"{path}: objects in a bucket cannot be appended to")
    return _epath(path).open(mode)


def exists(path: str) -> bool:
    return _epath(path).exists() if is_bucket(path) else os.path.exists(path)


def isdir(path: str) -> bool:
    return _epath(path).is_dir() if is_bucket(path) else os.path.isdir(path)


def listdir(path: str) -> list[str]:
    """The names in directory `path` (none if it does not exist)."""
    if is_bucket(path):
        directory = _epath(path)
        return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def remove(path: str) -> None:
    if is_bucket(path):
        _epath(path).unlink()
    else:
        os.remove(path)


def stat(path: str) -> tuple[int, int]:
    """(bytes, mtime_ns) of a file; for a bucket object its generation stands for the
    mtime (a number that changes whenever the object is written)."""
    if not is_bucket(path):
        info = os.stat(path)
        return info.st_size, info.st_mtime_ns
    info = _filesystem().info(path)
    return int(info["size"]), int(info.get("generation") or 0)


def glob(pattern: str) -> list[str]:
    """The files (not directories) a glob matches, bucket URLs included; `**` recurses."""
    if not is_bucket(pattern):
        import glob as glob_lib

        return [p for p in glob_lib.glob(os.path.expanduser(pattern), recursive=True)
                if os.path.isfile(p)]
    fs = _filesystem()
    return [BUCKET_PREFIX + p for p in fs.glob(pattern) if fs.isfile(p)]


def local_copy(url: str) -> str:
    """A local copy of bucket object or directory `url`, for readers that take local paths
    only (array_record's, so TFDS's too). Made once per version of the objects, under
    $JDP_DATA_CACHE_DIR (default ~/.cache/jdp/bucket_data): copied to a temporary name,
    then renamed, so processes sharing the cache never read a partial copy. The partial
    copies of processes of this machine that were killed midway are removed first."""
    fs = _filesystem()
    objects = fs.find(url, detail=True) if fs.isdir(url) else {url: fs.info(url)}
    version = hashlib.sha1(json.dumps(sorted(
        (name, info.get("size"), info.get("generation")) for name, info in objects.items()
    )).encode()).hexdigest()[:12]
    root = os.environ.get("JDP_DATA_CACHE_DIR") or os.path.expanduser(
        os.path.join("~", ".cache", "jdp", "bucket_data"))
    target = os.path.join(root, version, url[len(BUCKET_PREFIX):])
    if os.path.exists(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    leftovers.remove_dead(os.path.join(root, version), r"\.partial", "[0-9a-f]+")
    tmp = os.path.join(root, version, f".partial-{leftovers.tag()}-{uuid.uuid4().hex}")
    if len(objects) == 1 and url in objects:
        fs.get_file(url, tmp)
    else:
        prefix = url[len(BUCKET_PREFIX):].rstrip("/") + "/"
        for name in objects:
            local = os.path.join(tmp, name[len(prefix):])
            os.makedirs(os.path.dirname(local), exist_ok=True)
            fs.get_file(name, local)
    try:
        os.rename(tmp, target)
    except OSError:  # another process finished the same copy first
        if not os.path.exists(target):
            raise
    return target


def staging_dir(kind: str) -> str:
    """A new local directory for files on their way to a bucket (`upload`), named for this
    machine and process: `jdp-KIND-HOST-PID-*` in the temporary directory. Those that
    processes of this machine no longer running left behind (killed before they could
    remove theirs) are removed first, so a job restarted after kill -9 does not pile
    them up. Another machine's, or a live process's, are never touched."""
    root = tempfile.gettempdir()
    # After PID, mkdtemp's random suffix: lowercase letters, digits and "_".
    leftovers.remove_dead(root, re.escape(f"jdp-{kind}"), "[a-z0-9_]+")
    return tempfile.mkdtemp(prefix=f"jdp-{kind}-{leftovers.tag()}-")


def upload(local_dir: str, url: str) -> None:
    """Copies the files under `local_dir` to the same relative names under bucket `url`."""
    fs = _filesystem()
    for directory, _, names in os.walk(local_dir):
        for name in names:
            local = os.path.join(directory, name)
            fs.put_file(local, f"{url.rstrip('/')}/{os.path.relpath(local, local_dir)}")


def _epath(path: str):
    from etils import epath

    return epath.Path(path)
