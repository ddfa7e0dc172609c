"""A compiled package's manifest: written into the package (.pt2) by `compile_for_inference`, read and checked before
any of the package's code is loaded.

A package is executable code: AOTInductor's shared object in it runs when the package is loaded, as a pickle's code
runs when it is unpickled. So a package is read first as a zip archive (zipfile, hashlib: nothing of it runs), and
refused with a ValueError naming the file and what is wrong: not a zip archive, cut off, no manifest, another format,
content that does not match the SHA-256 written at compile time (a damaged copy: flipped weight bytes in the shared
object, stale or recomputed zip CRCs), then what `compile_for_inference` compares with the model (fingerprint, torch
release, CPU instructions). The digest is in the file itself: it finds damage, not a package someone rewrote on
purpose, which is why only packages one compiled or trusts may be loaded.

The manifest (`MANIFEST`, a JSON entry under the archive's folder, which AOTInductor's loader ignores) holds the
fields it was given and "sha256": the digest of those fields and of every other entry of the archive (name, size,
content; the weights are in the shared object).
"""

import hashlib
import json
import os
import zipfile

MANIFEST = "bert_impl/manifest.json"  # under the archive's folder (AOTInductor's loader wants every entry in it)
ZIP_START = b"PK\x03\x04"  # how a zip archive's first entry begins
AGAIN = "delete it and compile the model there again, or copy the package again from where it was compiled"


def write_manifest(package_path: str, fields: dict) -> None:
    """Add the manifest of `fields` and of the archive's content to the package at `package_path`."""
    with zipfile.ZipFile(package_path, "a") as archive:
        folder = archive.namelist()[0].split("/")[0]
        manifest = {**fields, "sha256": content_digest(archive, fields)}
        archive.writestr(f"{folder}/{MANIFEST}", json.dumps(manifest, indent=1))


def content_digest(archive: zipfile.ZipFile, fields: dict) -> str:
    """SHA-256 of the manifest's `fields` and of every entry of `archive` but the manifest (names, sizes, contents,
    in name order). Reading an entry checks its zip CRC too (zipfile.BadZipFile where it fails)."""
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    for info in sorted(archive.infolist(), key=lambda info: info.filename):
        if info.filename.endswith("/" + MANIFEST):
            continue
        digest.update(f"{info.filename}\0{info.file_size}\0".encode())
        with archive.open(info) as entry:
            while chunk := entry.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def read_manifest(package_path: str, format: str) -> dict:
    """The manifest of the package at `package_path`, once the file is a whole zip archive of package `format` whose
    content matches its digest; else a ValueError naming the file, what is wrong and what to do. Nothing of the
    package is loaded."""
    where = f"package_path: {package_path}"
    size = os.path.getsize(package_path)
    if size == 0:
        raise ValueError(f"{where} is empty (0 bytes); {AGAIN}")
    try:
        archive = zipfile.ZipFile(package_path)
    except zipfile.BadZipFile:
        with open(package_path, "rb") as file:
            start = file.read(len(ZIP_START))
        if start == ZIP_START:
            raise ValueError(f"{where} is cut off at byte {size}: it begins as a zip archive but lacks the directory "
                             f"that ends a whole one (a copy or download that stopped early?); {AGAIN}") from None
        raise ValueError(f"{where} is not a zip archive (it begins with {start!r}), so not a package "
                         f"compile_for_inference wrote; give the path of a .pt2 package, or {AGAIN}") from None
    with archive:
        names = [name for name in archive.namelist() if name.endswith("/" + MANIFEST)]
        if not names:
            raise ValueError(f"{where} has no bert-impl manifest: it was not written by compile_for_inference, or by "
                             f"an older release than the one here (format {format!r}); {AGAIN}")
        try:
            manifest = json.loads(archive.read(names[-1]))
            recorded = manifest.pop("sha256")
        except (ValueError, KeyError, zipfile.BadZipFile) as error:
            raise ValueError(f"{where} is damaged: its manifest cannot be read ({error}); {AGAIN}") from None
        if manifest.get("format") != format:
            raise ValueError(f"{where} was compiled from another package format (format {manifest.get('format')!r}, "
                             f"here {format!r}); {AGAIN}")
        try:
            found = content_digest(archive, manifest)
        except (zipfile.BadZipFile, EOFError, OSError) as error:
            raise ValueError(f"{where} is damaged: {error}; {AGAIN}") from None
    if found != recorded:
        raise ValueError(f"{where} is damaged: its content's SHA-256 is {found}, not the {recorded} written when it "
                         f"was compiled; {AGAIN}")
    return manifest
