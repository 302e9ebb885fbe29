#!/usr/bin/env bash
# Build Clockwork's two Debian packages with dpkg-deb, the way pyxis ships its SPANK plugin (`make deb`):
#
#   clockwork-slurm        the venv under /opt/clockwork/venv (this checkout with the `node` extra, on Debian's
#                          /usr/bin/python3.11), its four programs (clockwork, clockworkd, clockwork-hook,
#                          clockwork-healthcheck; `clockwork` also linked into /usr/bin), the systemd unit, and
#                          /etc/clockwork/clockwork.toml as a conffile;
#   clockwork-slurm-spank  clockwork.so built against the installed libslurm-dev, in Slurm's plugin folder, and
#                          /etc/slurm/plugstack.conf.d/clockwork.conf (a conffile). Its Depends pins the Slurm
#                          release series of those headers: Slurm refuses a plugin built for another series.
#
# Usage: packaging/deb/build.sh [OUTDIR] (default build/deb); DEB_MAINTAINER sets the Maintainer field. Needs root (file ownership), dpkg-deb, gcc,
# libslurm-dev, python3.11 with venv, and the Python registry for the venv's dependencies.
# ONLY=spank builds the plugin package alone (no venv, no network).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "${1:-build/deb}")
WORK="$OUT/stage"
ARCH=$(dpkg --print-architecture)
MULTIARCH=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
MAINTAINER=${DEB_MAINTAINER:-"Clockwork for Slurm maintainers <clockwork-slurm@example.org>"}
rm -rf "$WORK"
mkdir -p "$WORK" "$OUT"

finish() {  # $1 = package folder: sizes, md5sums, modes, then dpkg-deb --root-owner-group
	local pkg=$1 name
	name=$(basename "$pkg")
	find "$pkg" -path "$pkg/DEBIAN" -prune -o -type d -exec chmod 0755 {} +
	(cd "$pkg" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z | xargs -0r md5sum >DEBIAN/md5sums)
	chmod 0644 "$pkg/DEBIAN/md5sums" "$pkg/DEBIAN/control"
	[ ! -f "$pkg/DEBIAN/conffiles" ] || chmod 0644 "$pkg/DEBIAN/conffiles"
	local size
	size=$(du -sk --exclude=DEBIAN "$pkg" | cut -f1)
	sed -i "s/^Installed-Size: .*/Installed-Size: $size/" "$pkg/DEBIAN/control"
	dpkg-deb --root-owner-group -Zgzip --build "$pkg" "$OUT/${name}_${VERSION}_${ARCH}.deb" >/dev/null
	echo "built $OUT/${name}_${VERSION}_${ARCH}.deb"
}

docs() {  # $1 = package folder, $2 = package name: copyright and a changelog, as Debian policy asks
	local d="$1/usr/share/doc/$2"
	mkdir -p "$d"
	printf 'Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\nUpstream-Name: clockwork-slurm\n\nFiles: *\nCopyright: 2026 Clockwork for Slurm authors\nLicense: proprietary\n' >"$d/copyright"
	printf '%s (%s) unstable; urgency=medium\n\n  * Built from the clockwork-slurm checkout.\n\n -- %s  %s\n' \
		"$2" "$VERSION" "$MAINTAINER" "$(date -R -d @"${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}")" |
		gzip -9n >"$d/changelog.gz"
	chmod 0644 "$d/copyright" "$d/changelog.gz"
}

# ----- clockwork-slurm-spank -----------------------------------------------------------------------------------
SLURM_DEV=$(dpkg-query -W -f='${Version}' libslurm-dev)
SERIES=$(echo "$SLURM_DEV" | cut -d. -f1-2)
NEXT=$(echo "$SERIES" | awk -F. '{printf "%s.%02d", $1, $2 + 1}')
make --no-print-directory -C spank OUT="$WORK/spank-build" >/dev/null
PKG="$WORK/clockwork-slurm-spank"
install -D -m 0644 "$WORK/spank-build/clockwork.so" "$PKG/usr/lib/$MULTIARCH/slurm-wlm/clockwork.so"
strip --strip-unneeded "$PKG/usr/lib/$MULTIARCH/slurm-wlm/clockwork.so"
install -D -m 0644 etc/plugstack.conf.d/clockwork.conf "$PKG/etc/slurm/plugstack.conf.d/clockwork.conf"
docs "$PKG" clockwork-slurm-spank
mkdir -p "$PKG/DEBIAN"
echo /etc/slurm/plugstack.conf.d/clockwork.conf >"$PKG/DEBIAN/conffiles"
cat >"$PKG/DEBIAN/control" <<CONTROL
Package: clockwork-slurm-spank
Version: $VERSION
Architecture: $ARCH
Maintainer: $MAINTAINER
Installed-Size: 0
Depends: libc6, slurm-client (>= $SERIES~), slurm-client (<< $NEXT~)
Recommends: clockwork-slurm
Section: admin
Priority: optional
Description: Clockwork for Slurm: SPANK plugin (built for Slurm $SERIES)
 Adds --clockwork-ft, --clockwork-spares, --clockwork-snapshot and
 --clockwork-linkpass to sbatch, salloc and srun, and passes them to the job
 and to the Prolog/Epilog.
 .
 Built against libslurm-dev $SLURM_DEV. Slurm loads a SPANK plugin
 only from its own release series.
CONTROL
finish "$PKG"
[ "${ONLY:-}" = spank ] && exit 0

# ----- clockwork-slurm ------------------------------------------------------------------------------------------
PKG="$WORK/clockwork-slurm"
VENV=/opt/clockwork/venv
STAGED="$PKG$VENV"
/usr/bin/python3.11 -m venv "$STAGED"
"$STAGED/bin/pip" install -q --disable-pip-version-check --no-compile ".[node]"
# The venv was made in the staging folder: point it at the path it is installed to.
grep -rlI --null "$STAGED" "$STAGED/bin" "$STAGED/pyvenv.cfg" | xargs -0r sed -i "s|$STAGED|$VENV|g"
find "$STAGED" -name __pycache__ -prune -exec rm -rf {} +
# The wheels' shared objects are shipped as built: strip breaks the ones auditwheel repaired (numpy's bundled
# OpenBLAS: "ELF load command address/offset not page-aligned"), and the package's numpy would not import.
rm -rf "$STAGED"/lib/python3.11/site-packages/pip "$STAGED"/lib/python3.11/site-packages/pip-*.dist-info "$STAGED"/bin/pip*
find "$STAGED" -type f -name '*.so*' -exec chmod 0644 {} +
mkdir -p "$PKG/usr/bin"
ln -s "$VENV/bin/clockwork" "$PKG/usr/bin/clockwork"
# Its manual page: the command's own --help (so it never goes stale), as help2man would lay it out.
mkdir -p "$PKG/usr/share/man/man1"
{
	printf '.TH CLOCKWORK 1 "" "clockwork-slurm %s" "User Commands"\n.SH NAME\nclockwork \\- Clockwork for Slurm command line\n' "$VERSION"
	printf '.SH DESCRIPTION\n.nf\n'
	"$STAGED/bin/python" -c 'from clockwork.cli.main import cli; cli(["--help"], prog_name="clockwork")' | sed -e 's/\\/\\e/g' -e "s/^[.']/\\\\\&&/"
	printf '.fi\n.SH SEE ALSO\nclockwork COMMAND --help, and the guides in the clockwork-slurm sources (docs/).\n'
} | gzip -9n >"$PKG/usr/share/man/man1/clockwork.1.gz"
chmod 0644 "$PKG/usr/share/man/man1/clockwork.1.gz"
# The venv must load what a node runs (the page above loaded the command line): the daemon, its C extensions, the
# hooks. A package that cannot is not built.
"$STAGED/bin/python" -c 'import clockworkd.server, clockworkd.lens._probeio, linkpass._hbfast, slurm_hooks.runner'
# What lintian reports of any bundled venv, by design here (the issue asks for the venv under /opt, as sites run
# it): files in /opt, the venv's own interpreter, and the wheels' own bundled libraries, scripts and fonts.
install -d "$PKG/usr/share/lintian/overrides"
cat >"$PKG/usr/share/lintian/overrides/clockwork-slurm" <<'OVERRIDES'
clockwork-slurm: dir-or-file-in-opt [opt/*]
clockwork-slurm: unusual-interpreter /opt/clockwork/venv/bin/python3.11 [opt/clockwork/venv/bin/*]
clockwork-slurm: unusual-interpreter python [opt/clockwork/venv/lib/python3.11/site-packages/*]
clockwork-slurm: embedded-library * [opt/clockwork/venv/lib/python3.11/site-packages/*]
clockwork-slurm: unstripped-binary-or-object [opt/clockwork/venv/lib/python3.11/site-packages/*]
clockwork-slurm: duplicate-font-file * [opt/clockwork/venv/lib/python3.11/site-packages/*]
clockwork-slurm: script-not-executable [opt/clockwork/venv/lib/python3.11/site-packages/*]
clockwork-slurm: shared-library-lacks-prerequisites [opt/clockwork/venv/lib/python3.11/site-packages/*]
clockwork-slurm: library-not-linked-against-libc [opt/clockwork/venv/lib/python3.11/site-packages/*]
clockwork-slurm: python3-script-but-no-python3-dep * [opt/clockwork/venv/lib/python3.11/site-packages/*]
OVERRIDES
chmod 0644 "$PKG/usr/share/lintian/overrides/clockwork-slurm"
install -D -m 0644 etc/systemd/clockworkd.service "$PKG/lib/systemd/system/clockworkd.service"
install -D -m 0644 etc/clockwork.toml "$PKG/etc/clockwork/clockwork.toml"
docs "$PKG" clockwork-slurm
mkdir -p "$PKG/DEBIAN"
echo /etc/clockwork/clockwork.toml >"$PKG/DEBIAN/conffiles"
cat >"$PKG/DEBIAN/postinst" <<'SCRIPT'
#!/bin/sh
# Byte-compile the venv (not shipped: the files would name the build folder), as Python packages do.
set -e
if [ "$1" = configure ]; then
	/opt/clockwork/venv/bin/python -m compileall -q /opt/clockwork/venv/lib >/dev/null || true
fi
#DEBHELPER#
SCRIPT
sed -i '/#DEBHELPER#/d' "$PKG/DEBIAN/postinst"
cat >"$PKG/DEBIAN/prerm" <<'SCRIPT'
#!/bin/sh
set -e
find /opt/clockwork/venv -name __pycache__ -prune -exec rm -rf {} + 2>/dev/null || true
SCRIPT
chmod 0755 "$PKG/DEBIAN/postinst" "$PKG/DEBIAN/prerm"
cat >"$PKG/DEBIAN/control" <<CONTROL
Package: clockwork-slurm
Version: $VERSION
Architecture: $ARCH
Maintainer: $MAINTAINER
Installed-Size: 0
Depends: python3.11, libc6, libsodium23
Recommends: clockwork-slurm-spank, slurm-client
Section: admin
Priority: optional
Description: Clockwork for Slurm: node daemon, Slurm hooks and command line
 The venv under /opt/clockwork/venv with clockwork (command line), clockworkd
 (the node daemon, a systemd unit), clockwork-hook (Prolog, Epilog,
 PrologSlurmctld, EpilogSlurmctld) and clockwork-healthcheck
 (HealthCheckProgram). /etc/clockwork/clockwork.toml is a conffile.
CONTROL
finish "$PKG"
