#!/usr/bin/env bash
# Static audit of a shared rootstock install: can every user on the cluster read it?
#
#   scripts/check_world_readable.sh ROOT [ROOT ...]
#
# Pass the install root and, where it is separate, the cache root. Needs only bash,
# GNU find/stat/realpath and getfacl (the acl package); rootstock need not be
# importable. The tree is walked once by find and once by getfacl, never with a
# process per file, so it is usable on large installs.
#
# Checks, each printed with an actionable fix:
#   ancestor        a directory above ROOT that others cannot traverse (o+x)
#   file-unreadable a file others cannot read (o+r)
#   file-noexec     a file its owner can execute but others cannot (o+x)
#   dir-unreadable  a directory others cannot list or traverse (o+rx)
#   dir-nosetgid    a directory without setgid (new files lose the project group)
#   world-writable  anything writable by others, except the sticky 1777 usage spool
#                   and empty *.lock files (uv creates its advisory lock files 0666
#                   on purpose; they are counted in a note, and AUDIT_STRICT=1 makes
#                   them violations)
#   symlink         a dangling symlink, or one whose target outside the roots (or a
#                   directory above that target) others cannot use
#   user-acl        a per-user ACL entry (access or default)
#   mask-clamp      an ACL mask without read: group entries lose read
#   default-acl     a default ACL whose mask or other entry lacks read: new files
#                   will not be readable
#   locks-open      the install's lock directory ROOT/.locks grants others access:
#                   a read lock needs only read access, so anyone who can open a
#                   lock file can stall every maintainer's write
# The contents of the usage spool (any sticky, world-writable directory) are users'
# private records and are skipped, and so is ROOT/.locks, the one directory that
# must be closed to others (the maintainers' lock files).
#
# Exit status: 0 no violations; 1 violations were printed; 2 usage error, or the
# audit could not complete (a root is missing, or getfacl is not installed).
# At most $AUDIT_MAX_PER_KIND (default 25) paths are printed per kind and root,
# followed by one command that fixes them all.
set -uo pipefail

MAX_PER_KIND=${AUDIT_MAX_PER_KIND:-25}
STRICT=${AUDIT_STRICT:-0}

if [ $# -lt 1 ] || [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    [ $# -lt 1 ] && exit 2
    exit 0
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

violations=0
incomplete=0
benign_locks=0
declare -A printed=()
declare -A hidden=()
declare -A bulk_fix=()

q() { printf '%q' "$1"; }

# will_print KIND: true while KIND is under its print limit. Otherwise the caller
# counts the violation with hide_one and skips formatting it (big trees stay fast).
will_print() { [ "${printed[$1]:-0}" -lt "$MAX_PER_KIND" ]; }
hide_one() {
    violations=$((violations + 1))
    hidden[$1]=$((${hidden[$1]:-0} + 1))
}

# violation KIND PATH PROBLEM FIX
violation() {
    violations=$((violations + 1))
    local n=${printed[$1]:-0}
    if [ "$n" -lt "$MAX_PER_KIND" ]; then
        printf '[%s] %s: %s\n    fix: %s\n' "$1" "$2" "$3" "$4"
        printed[$1]=$((n + 1))
    else
        hidden[$1]=$((${hidden[$1]:-0} + 1))
    fi
}

# Octal mode of a path (following links), or empty if it cannot be stat'ed.
mode_of() { stat -L -c '%a' -- "$1" 2>/dev/null; }

# other_has MODE BITS: true when the other-bits of octal MODE include all of BITS (r=4 w=2 x=1).
other_has() { (((8#$1 & $2) == $2)); }

# check_ancestors PATH WHAT: every directory above PATH, as given and resolved, needs o+x.
declare -A ancestors_seen=()
check_ancestors() {
    local path=$1 what=$2 dir m
    for start in "$path" "$(realpath -m -- "$path")"; do
        dir=$(dirname -- "$start")
        while :; do
            if [ -z "${ancestors_seen[$dir]:-}" ]; then
                ancestors_seen[$dir]=1
                m=$(mode_of "$dir")
                if [ -z "$m" ]; then
                    violation ancestor "$dir" "cannot stat it (needed by $what)" \
                        "check that $(q "$dir") exists and is reachable"
                elif ! other_has "$m" 1; then
                    violation ancestor "$dir" "others cannot traverse it (mode $m, needed by $what)" \
                        "chmod o+x $(q "$dir")   (not yours? ask its owner, or file a facilities ticket)"
                fi
            fi
            [ "$dir" = / ] && break
            dir=$(dirname -- "$dir")
        done
    done
}

# check_outside_target TARGET LINK COUNT: a symlink target outside every root.
check_outside_target() {
    local target=$1 link=$2 count=$3 m fix
    local via="the link $link"
    [ "$count" -gt 1 ] && via="$via and $((count - 1)) other link(s)"
    check_ancestors "$target" "$via"
    m=$(mode_of "$target")
    [ -n "$m" ] || return
    if [ -d "$target" ]; then
        other_has "$m" 5 || violation symlink "$target" \
            "others cannot list or traverse this link target (mode $m; via $via)" \
            "chmod o+rx $(q "$target"), or point the link at a world-readable copy"
    else
        fix="chmod o+r $(q "$target"), or point the link at a world-readable copy"
        other_has "$m" 4 || violation symlink "$target" \
            "others cannot read this link target (mode $m; via $via)" "$fix"
        if ((8#$m & 8#100)) && ! other_has "$m" 1; then
            violation symlink "$target" \
                "others cannot execute this link target (mode $m; via $via)" \
                "chmod o+x $(q "$target"), or rebuild on a world-usable interpreter"
        fi
    fi
}

audit_tree() {
    local root=$1 kind m path
    local rows=$WORK/rows links=$WORK/links targets=$WORK/targets spools=$WORK/spools
    local locks=$root/.locks locks_pattern

    # The lock directory must be the maintainers' alone.
    if [ -d "$locks" ] && [ ! -L "$locks" ]; then
        m=$(mode_of "$locks")
        if [ -n "$m" ] && (((8#$m & 7) != 0)); then
            violation locks-open "$locks" \
                "others can open the install's lock files (mode $m): a read lock on one stalls every maintainer's write" \
                "chmod -R o-rwx $(q "$locks")   (as its owner)"
        fi
    fi
    # find -path takes a glob: escape the root's own glob characters.
    locks_pattern=$(printf '%s' "$locks" | sed 's/[][*?\\]/\\&/g')

    # One walk. A sticky, world-writable directory is the usage spool: its own mode
    # is right by definition and its contents are users' private records. The lock
    # directory is closed to others on purpose (checked above).
    find "$root" \( -path "$locks_pattern" -prune \) -o \
        \( -type d -perm -1007 -fprintf "$spools" '%p\0' -prune \) -o \( \
        \( -type f ! -perm -o=r -printf 'file-unreadable\t%m\t%p\0' \) , \
        \( -type f -perm /u=x ! -perm -o=x -printf 'file-noexec\t%m\t%p\0' \) , \
        \( -type d ! -perm -o=rx -printf 'dir-unreadable\t%m\t%p\0' \) , \
        \( -type d ! -perm -g=s -printf 'dir-nosetgid\t%m\t%p\0' \) , \
        \( -type f -empty -name '*.lock' -perm -o=w -printf 'uv-lock\t%m\t%p\0' \) , \
        \( ! -type l -perm -o=w ! \( -type f -empty -name '*.lock' \) \
            -printf 'world-writable\t%m\t%p\0' \) , \
        \( -type l -fprintf "$links" '%p\0' \) \
        \) >"$rows" 2>"$WORK/errors"
    if [ -s "$WORK/errors" ]; then
        while IFS= read -r line; do
            violation unreadable-by-auditor "$root" "$line" \
                "run the audit as the install's owner, or fix the path it names"
        done <"$WORK/errors"
    fi

    local qp
    while IFS=$'\t' read -r -d '' kind m path; do
        if [ "$kind" = uv-lock ]; then
            if [ "$STRICT" != 1 ]; then
                benign_locks=$((benign_locks + 1))
                continue
            fi
            kind=world-writable
        fi
        if ! will_print "$kind"; then
            hide_one "$kind"
            continue
        fi
        printf -v qp '%q' "$path"
        case $kind in
        file-unreadable)
            violation "$kind" "$path" "others cannot read it (mode $m)" "chmod o+r $qp" ;;
        file-noexec)
            violation "$kind" "$path" "its owner can execute it but others cannot (mode $m)" \
                "chmod o+x $qp" ;;
        dir-unreadable)
            violation "$kind" "$path" "others cannot list or traverse it (mode $m)" \
                "chmod o+rx $qp" ;;
        dir-nosetgid)
            violation "$kind" "$path" "no setgid bit (mode $m): new files get their creator's group" \
                "chmod g+s $qp" ;;
        world-writable)
            violation "$kind" "$path" "anyone can write it (mode $m)" "chmod o-w $qp" ;;
        esac
    done <"$rows"
    bulk_fix[file-unreadable]="find ROOT -type f ! -perm -o=r -exec chmod o+r {} +"
    bulk_fix[file-noexec]="find ROOT -type f -perm /u=x ! -perm -o=x -exec chmod o+x {} +"
    bulk_fix[dir-unreadable]="find ROOT -type d ! -perm -o=rx -exec chmod o+rx {} +"
    bulk_fix[dir-nosetgid]="find ROOT -type d ! -perm -g=s -exec chmod g+s {} +"
    bulk_fix[world-writable]="find ROOT ! -type l -perm -o=w ! -perm -1000 -exec chmod o-w {} +"
    bulk_fix[user-acl]="setfacl -R -x u:NAME ROOT   (for each NAME listed above)"
    bulk_fix[mask-clamp]="setfacl -R -m m::rwX ROOT"

    # Symlinks: resolve all targets in a few batched realpath calls.
    if [ -s "$links" ]; then
        xargs -0 -r realpath -m -z -- <"$links" >"$targets"
        declare -A outside_count=() outside_link=()
        local link target r inside
        while IFS= read -r -d '' link && IFS= read -r -d '' target <&3; do
            if [ ! -e "$target" ]; then
                violation symlink "$link" "dangling: its target $target does not exist" \
                    "restore $(q "$target"), or remove the link: rm $(q "$link")"
                continue
            fi
            inside=
            for r in "${ROOTS_REAL[@]}"; do
                case $target/ in "$r"/*) inside=1 && break ;; esac
            done
            [ -n "$inside" ] && continue
            outside_count[$target]=$((${outside_count[$target]:-0} + 1))
            [ -n "${outside_link[$target]:-}" ] || outside_link[$target]=$link
        done <"$links" 3<"$targets"
        for target in "${!outside_count[@]}"; do
            check_outside_target "$target" "${outside_link[$target]}" "${outside_count[$target]}"
        done
    fi

    # ACLs, which ls -l does not show: one recursive getfacl, parsed by awk.
    if ! command -v getfacl >/dev/null 2>&1; then
        incomplete=1
        return
    fi
    local entry name label
    # The lock directory's entries are skipped like the spool's.
    printf '%s\0' "$locks" >>"$spools"
    while IFS=$'\t' read -r kind path entry; do
        label=$kind
        [[ $kind == default-acl-* ]] && label=default-acl
        if ! will_print "$label"; then
            hide_one "$label"
            continue
        fi
        printf -v path '%b' "$path"
        printf -v qp '%q' "$path"
        case $kind in
        user-acl)
            name=${entry#default:}
            name=${name#user:}
            name=${name%%:*}
            if [[ $entry == default:* ]]; then
                violation user-acl "$path" "per-user default ACL entry $entry: grant through the group" \
                    "setfacl -x d:u:$name $qp"
            else
                violation user-acl "$path" "per-user ACL entry $entry: grant through the group" \
                    "setfacl -x u:$name $qp"
            fi ;;
        mask-clamp)
            violation mask-clamp "$path" "ACL $entry: group entries cannot read it" \
                "setfacl -m m::rwX $qp" ;;
        default-acl-mask)
            violation default-acl "$path" "$entry: files created here will be unreadable by the group" \
                "setfacl -d -m m::rwx $qp" ;;
        default-acl-other)
            violation default-acl "$path" "$entry: files created here will not be world-readable" \
                "setfacl -d -m o::r-x $qp" ;;
        esac
    done < <(getfacl -R -P -s -p -- "$root" 2>/dev/null | awk -v spools="$(tr '\0' '\n' <"$spools")" '
        BEGIN { n = split(spools, s, "\n") }
        /^# file: / {
            file = substr($0, 9); skip = 0
            for (i = 1; i <= n; i++)
                if (s[i] != "" && (file == s[i] || index(file, s[i] "/") == 1)) skip = 1
            next
        }
        skip || /^#/ || /^$/ { next }
        { sub(/[ \t]+#effective:.*/, "") }
        /^user:[^:]+:/ || /^default:user:[^:]+:/ { print "user-acl\t" file "\t" $0; next }
        /^mask::/ && substr($0, 7, 1) != "r" { print "mask-clamp\t" file "\t" $0; next }
        /^default:mask::/ && substr($0, 15, 1) != "r" { print "default-acl-mask\t" file "\t" $0; next }
        /^default:other::/ && substr($0, 16, 1) != "r" { print "default-acl-other\t" file "\t" $0 }
    ')
}

ROOTS=()
ROOTS_REAL=()
for arg in "$@"; do
    if [ ! -d "$arg" ]; then
        echo "error: $arg is not a directory" >&2
        incomplete=1
        continue
    fi
    ROOTS+=("$(realpath -s -- "$arg")")
    ROOTS_REAL+=("$(realpath -- "$arg")")
done

for root in "${ROOTS[@]}"; do
    printed=() hidden=()
    echo "== $root"
    check_ancestors "$root" "the install at $root"
    audit_tree "$root"
    for kind in "${!hidden[@]}"; do
        fix=${bulk_fix[$kind]:-"rootstock setup-perms ROOT --group GROUP --retrofit --apply"}
        echo "[$kind] ... and ${hidden[$kind]} more under $root; fix them all with:"
        echo "    ${fix//ROOT/$(q "$root")}"
    done
done

if [ "$benign_locks" -gt 0 ]; then
    echo "note: $benign_locks empty lock file(s) are world-writable: uv creates its advisory" \
        "lock files 0666 by design; known benign (docs/permissions.md), AUDIT_STRICT=1 counts them"
fi
if [ "$incomplete" -eq 1 ] && ! command -v getfacl >/dev/null 2>&1; then
    echo "warning: getfacl not found (install the acl package): per-user ACL entries," \
        "mask clamps and default ACLs were NOT checked" >&2
fi
if [ "$violations" -gt 0 ]; then
    echo "FAIL: $violations violation(s). To fix a whole tree at once, as its owner:" \
        "rootstock setup-perms ROOT --group GROUP --retrofit --apply"
    exit 1
fi
if [ "$incomplete" -eq 1 ]; then
    echo "INCOMPLETE: no violations found, but the audit could not check everything" >&2
    exit 2
fi
echo "ok: no violations in ${ROOTS[*]}"
exit 0
