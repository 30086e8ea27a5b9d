#!/bin/sh
# Install Mixdesk's menu entry and icons for the current user (no root needed).
#   packaging/install-desktop.sh                    Exec=mixdesk (from `pip install .`, on PATH)
#   packaging/install-desktop.sh "$PWD/dist/mixdesk/mixdesk"   the PyInstaller folder
# Honours XDG_DATA_HOME (default ~/.local/share). Undo: packaging/install-desktop.sh --uninstall
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
data=${XDG_DATA_HOME:-$HOME/.local/share}
apps=$data/applications
icons=$data/icons/hicolor
if [ "${1:-}" = "--uninstall" ]; then
    rm -f "$apps/mixdesk.desktop" "$icons/scalable/apps/mixdesk.svg"
    for s in 16 32 48 128 256; do rm -f "$icons/${s}x${s}/apps/mixdesk.png"; done
    echo "mixdesk: removed the desktop entry and icons from $data"
else
    exec_cmd=${1:-mixdesk}
    mkdir -p "$apps"
    for s in 16 32 48 128 256; do
        install -D -m 644 "$here/resources/icons/mixdesk-$s.png" "$icons/${s}x${s}/apps/mixdesk.png"
    done
    install -D -m 644 "$here/resources/icons/mixdesk.svg" "$icons/scalable/apps/mixdesk.svg"
    if command -v desktop-file-install >/dev/null 2>&1; then
        desktop-file-install --dir="$apps" --set-key=Exec --set-value="$exec_cmd" \
            --set-key=TryExec --set-value="$exec_cmd" "$here/resources/mixdesk.desktop"
    else
        sed -e "s|^Exec=.*|Exec=$exec_cmd|" -e "s|^TryExec=.*|TryExec=$exec_cmd|" \
            "$here/resources/mixdesk.desktop" > "$apps/mixdesk.desktop"
    fi
    echo "mixdesk: installed $apps/mixdesk.desktop (Exec=$exec_cmd) and icons"
fi
command -v update-desktop-database >/dev/null 2>&1 && update-desktop-database -q "$apps" || true
command -v gtk-update-icon-cache >/dev/null 2>&1 && gtk-update-icon-cache -q -t "$icons" || true
