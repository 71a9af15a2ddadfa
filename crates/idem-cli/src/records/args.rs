//! The command line of `idem records show|delete`, parsed by hand like `check-config`.

use idem_store::Scope;
use idem_store::records::parse_scope_hex;

/// Which store, where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target {
    /// `--redis URL`.
    Redis(String),
    /// `--redis-cluster URL,URL…`.
    RedisCluster(Vec<String>),
    /// `--postgres URL`.
    Postgres(String),
}

/// Which record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Selector {
    /// Computed from `--tenant`, `--method`, `--key` as the server computes it; the
    /// method path is kept to find the response type with `--proto`.
    Call { scope: Scope, method_path: String },
    /// `--scope HEX`: the full scope (32 bytes) or a prefix of it.
    Hex(Vec<u8>),
}

/// A parsed `idem records show|delete` command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Args {
    pub(crate) target: Target,
    pub(crate) key_prefix: Option<String>,
    pub(crate) selector: Selector,
    pub(crate) protos: Vec<String>,
    pub(crate) includes: Vec<String>,
    pub(crate) json: bool,
    pub(crate) force: bool,
}

/// `pkg.Svc/Method` (or `/pkg.Svc/Method`) as the request path the server sees,
/// `/pkg.Svc/Method`.
pub(crate) fn method_path(method: &str) -> Result<String, String> {
    let m = method.strip_prefix('/').unwrap_or(method);
    match m.split_once('/') {
        Some((svc, name))
            if !svc.is_empty() && !name.is_empty() && !name.contains('/') && !m.contains(' ') =>
        {
            Ok(format!("/{m}"))
        }
        _ => Err(format!(
            "--method {method:?}: give the full method name as package.Service/Method \
             (e.g. shop.v1.Orders/CreateOrder), with one '/'"
        )),
    }
}

/// Parses the arguments after `show` or `delete`; `delete` accepts `--force`.
pub(crate) fn parse(args: &[&str], delete: bool) -> Result<Args, String> {
    let mut target = None;
    let mut set_target = |t: Target| {
        if target.replace(t).is_some() {
            Err("give one store: --redis, --redis-cluster or --postgres".to_owned())
        } else {
            Ok(())
        }
    };
    let (mut tenant, mut method, mut key, mut scope) = (None, None, None, None);
    let (mut key_prefix, mut protos, mut includes) = (None, Vec::new(), Vec::new());
    let (mut json, mut force) = (false, false);
    let mut it = args.iter();
    while let Some(&flag) = it.next() {
        let mut value = || {
            it.next()
                .map(|v| (*v).to_owned())
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag {
            "--redis" => set_target(Target::Redis(value()?))?,
            "--redis-cluster" => {
                let nodes: Vec<String> = value()?
                    .split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect();
                if nodes.is_empty() {
                    return Err("--redis-cluster needs at least one node URL".into());
                }
                set_target(Target::RedisCluster(nodes))?
            }
            "--postgres" => set_target(Target::Postgres(value()?))?,
            "--key-prefix" => key_prefix = Some(value()?),
            "--tenant" => tenant = Some(value()?),
            "--method" => method = Some(value()?),
            "--key" => key = Some(value()?),
            "--scope" => scope = Some(value()?),
            "--proto" => protos.push(value()?),
            "-I" | "--include" => includes.push(value()?),
            "--json" => json = true,
            "--force" if delete => force = true,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let target =
        target.ok_or("give a store: --redis URL, --redis-cluster URL,URL… or --postgres URL")?;
    let selector = match (tenant, method, key, scope) {
        (None, None, None, Some(hex)) => {
            Selector::Hex(parse_scope_hex(&hex).map_err(|e| format!("--scope {hex:?}: {e}"))?)
        }
        (Some(tenant), Some(method), Some(key), None) => {
            let path = method_path(&method)?;
            Selector::Call {
                scope: Scope::for_call(&tenant, &path, &key),
                method_path: path,
            }
        }
        (_, _, _, Some(_)) => {
            return Err("give either --scope HEX or --tenant, --method and --key, not both".into());
        }
        _ => {
            return Err(
                "give the record: --tenant T --method package.Service/Method --key K (all \
                 three), or --scope HEX"
                    .into(),
            );
        }
    };
    Ok(Args {
        target,
        key_prefix,
        selector,
        protos,
        includes,
        json,
        force,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn methods_need_one_slash_between_service_and_method() {
        assert_eq!(method_path("a.B/C").unwrap(), "/a.B/C");
        assert_eq!(method_path("/a.B/C").unwrap(), "/a.B/C");
        for bad in ["a.B.C", "a.B/", "/C", "a/B/C", "", "/"] {
            assert!(method_path(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_call_selector_is_the_servers_scope() {
        let a = parse(
            &[
                "--redis",
                "redis://x",
                "--tenant",
                "t",
                "--method",
                "p.S/M",
                "--key",
                "k",
            ],
            false,
        )
        .unwrap();
        assert_eq!(
            a.selector,
            Selector::Call {
                scope: Scope::for_call("t", "/p.S/M", "k"),
                method_path: "/p.S/M".into()
            }
        );
        assert!(parse(&["--redis", "r", "--scope", "zz"], false).is_err());
        assert!(
            parse(
                &[
                    "--redis",
                    "r",
                    "--postgres",
                    "p",
                    "--scope",
                    &"a".repeat(16)
                ],
                false
            )
            .is_err()
        );
        assert!(
            parse(
                &["--redis", "r", "--scope", &"a".repeat(16), "--force"],
                false
            )
            .is_err()
        );
        assert!(
            parse(
                &["--redis", "r", "--scope", &"a".repeat(16), "--force"],
                true
            )
            .unwrap()
            .force
        );
        assert!(parse(&["--redis", "r", "--tenant", "t"], false).is_err());
        assert!(parse(&["--redis"], false).is_err());
    }
}
