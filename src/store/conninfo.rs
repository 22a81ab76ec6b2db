//! Connection strings as libpq reads them: a `postgres://` URL or `key=value` pairs, the `PG*`
//! environment variables as defaults, the password file, and a redacted form for logs.
//!
//! tokio-postgres parses most of libpq's keys itself, but not the TLS ones (`sslmode` beyond
//! disable/prefer/require, `sslrootcert`, `sslcert`, `sslkey`) nor `passfile`: those are taken
//! out here, and the rest is handed to [`tokio_postgres::Config`].

use std::collections::HashMap;
use std::path::PathBuf;
use std::str::FromStr;

use super::passfile;
use super::tls::{SslMode, TlsFiles};

/// Keys tallyd reads itself; everything else goes to tokio-postgres.
const OWN_KEYS: [&str; 7] = [
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "passfile",
    "fallback_application_name",
    "sslsni",
];

/// libpq's environment variables for the keys tallyd reads itself.
const OWN_ENV: [(&str, &str); 6] = [
    ("sslmode", "PGSSLMODE"),
    ("sslrootcert", "PGSSLROOTCERT"),
    ("sslcert", "PGSSLCERT"),
    ("sslkey", "PGSSLKEY"),
    ("passfile", "PGPASSFILE"),
    ("sslsni", "PGSSLSNI"),
];

/// Where libpq looks when neither `host` nor `PGHOST` says (Debian's build).
const DEFAULT_SOCKET_DIR: &str = "/var/run/postgresql";

#[derive(Debug, thiserror::Error)]
pub enum ConninfoError {
    #[error("invalid connection string {redacted}: {reason}")]
    Syntax { redacted: String, reason: String },
    #[error("invalid connection string {redacted}: {reason}")]
    Driver { redacted: String, reason: String },
    #[error("connection string {redacted}: {cause}")]
    Tls {
        redacted: String,
        cause: super::tls::TlsError,
    },
}

/// A parsed connection string: what tokio-postgres needs, the TLS settings, and how to name the
/// database in messages without its password.
#[derive(Clone, Debug)]
pub struct Conninfo {
    pub config: tokio_postgres::Config,
    pub sslmode: SslMode,
    pub files: TlsFiles,
    pub sni: bool,
    /// `host=... port=... dbname=... user=...`, never a password.
    pub redacted: String,
    /// Set by the string or `PGAPPNAME`: tallyd's default must not override it.
    pub application_name_set: bool,
    pub fallback_application_name: Option<String>,
}

/// Parses `conninfo` with `env` for the `PG*` defaults (std::env::var in production; tests pass
/// their own so that they do not race on the process environment).
pub fn parse(
    conninfo: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Conninfo, ConninfoError> {
    let redacted = redact(conninfo);
    let syntax = |reason: String| ConninfoError::Syntax {
        redacted: redacted.clone(),
        reason,
    };
    let (rest, mut own) = split_own(conninfo).map_err(syntax)?;
    for (key, var) in OWN_ENV {
        if !own.contains_key(key) {
            if let Some(v) = env(var).filter(|v| !v.is_empty()) {
                own.insert(key.to_string(), v);
            }
        }
    }
    let mut config =
        tokio_postgres::Config::from_str(&rest).map_err(|err| ConninfoError::Driver {
            redacted: redacted.clone(),
            reason: innermost(&err),
        })?;
    let application_name_set = apply_env(&mut config, env);
    let home = env("HOME").map(PathBuf::from);
    if config.get_password().is_none() {
        let file = own
            .get("passfile")
            .map(PathBuf::from)
            .or_else(|| home.as_ref().map(|h| h.join(".pgpass")));
        if let Some(password) =
            file.and_then(|f| passfile::lookup(&f, &passfile::Entry::of(&config, env)))
        {
            config.password(password);
        }
    }
    let sslmode = match own.get("sslmode") {
        Some(v) => v.parse().map_err(syntax)?,
        None => SslMode::Prefer,
    };
    let files = TlsFiles::new(&own, home.as_deref());
    let sni = own.get("sslsni").is_none_or(|v| v != "0");
    Ok(Conninfo {
        redacted: describe(&config),
        config,
        sslmode,
        files,
        sni,
        application_name_set,
        fallback_application_name: own.get("fallback_application_name").cloned(),
    })
}

/// The deepest cause of a parse error: tokio-postgres wraps it in two "invalid connection
/// string" layers.
fn innermost(err: &tokio_postgres::Error) -> String {
    let mut text = err.to_string();
    let mut cause = std::error::Error::source(err);
    while let Some(c) = cause {
        text = c.to_string();
        cause = c.source();
    }
    text.trim_start_matches("invalid connection string: ")
        .to_string()
}

/// Fills what the string left unset from libpq's environment variables, as libpq does.
/// Returns whether `application_name` is set.
fn apply_env(config: &mut tokio_postgres::Config, env: &dyn Fn(&str) -> Option<String>) -> bool {
    let var = |name: &str| env(name).filter(|v| !v.is_empty());
    if config.get_hosts().is_empty() && config.get_hostaddrs().is_empty() {
        if let Some(addrs) = var("PGHOSTADDR") {
            for a in addrs.split(',').filter_map(|a| a.trim().parse().ok()) {
                config.hostaddr(a);
            }
        }
        match var("PGHOST") {
            Some(hosts) => hosts.split(',').for_each(|h| {
                config.host(h.trim());
            }),
            None if config.get_hostaddrs().is_empty() => {
                config.host(DEFAULT_SOCKET_DIR);
            }
            None => {}
        }
    }
    if config.get_ports().is_empty() {
        if let Some(ports) = var("PGPORT") {
            for p in ports.split(',').filter_map(|p| p.trim().parse().ok()) {
                config.port(p);
            }
        }
    }
    if config.get_user().is_none() {
        if let Some(user) = var("PGUSER") {
            config.user(user);
        }
    }
    if config.get_dbname().is_none() {
        if let Some(db) = var("PGDATABASE") {
            config.dbname(db);
        }
    }
    if config.get_password().is_none() {
        if let Some(p) = var("PGPASSWORD") {
            config.password(p);
        }
    }
    if config.get_options().is_none() {
        if let Some(o) = var("PGOPTIONS") {
            config.options(o);
        }
    }
    if config.get_application_name().is_none() {
        if let Some(a) = var("PGAPPNAME") {
            config.application_name(a);
        }
    }
    config.get_application_name().is_some()
}

/// Splits tallyd's own keys out of `conninfo`, returning the rest for tokio-postgres.
fn split_own(conninfo: &str) -> Result<(String, HashMap<String, String>), String> {
    let mut own = HashMap::new();
    if is_url(conninfo) {
        let (base, query) = conninfo.split_once('?').unwrap_or((conninfo, ""));
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| format!("parameter {k} has no value", k = pair))?;
            let key = percent_decode(k)?;
            if OWN_KEYS.contains(&key.as_str()) {
                own.insert(key, percent_decode(v)?);
            } else {
                kept.push(pair);
            }
        }
        let rest = if kept.is_empty() {
            base.to_string()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        return Ok((rest, own));
    }
    let mut kept = Vec::new();
    for (key, value) in key_values(conninfo)? {
        if OWN_KEYS.contains(&key.as_str()) {
            own.insert(key, value);
        } else {
            kept.push(format!("{key}={}", quote(&value)));
        }
    }
    Ok((kept.join(" "), own))
}

fn is_url(s: &str) -> bool {
    s.starts_with("postgres://") || s.starts_with("postgresql://")
}

/// libpq's `key = value` pairs: values bare (backslash escapes) or single-quoted (`\'`, `\\`).
fn key_values(s: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            return Ok(out);
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            return Err(format!("missing \"=\" after \"{key}\""));
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next() {
                    None => return Err(format!("unterminated quoted value for \"{key}\"")),
                    Some('\'') => break,
                    Some('\\') => value.extend(chars.next()),
                    Some(c) => value.push(c),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    value.extend(chars.next());
                } else {
                    value.push(c);
                }
            }
        }
        out.push((key, value));
    }
}

/// A value quoted for a key/value string when it needs to be.
pub fn quote(v: &str) -> String {
    if !v.is_empty()
        && !v
            .chars()
            .any(|c| c.is_whitespace() || c == '\'' || c == '\\')
    {
        return v.to_string();
    }
    let mut s = String::with_capacity(v.len() + 2);
    s.push('\'');
    for c in v.chars() {
        if c == '\'' || c == '\\' {
            s.push('\\');
        }
        s.push(c);
    }
    s.push('\'');
    s
}

fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .ok_or_else(|| format!("bad percent-encoding in {s:?}"))?;
            out.push(
                u8::from_str_radix(hex, 16)
                    .map_err(|_| format!("bad percent-encoding in {s:?}"))?,
            );
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("percent-encoding in {s:?} is not UTF-8"))
}

/// The connection string with any password replaced by `***`, for messages about a string
/// that did not parse.
pub fn redact(conninfo: &str) -> String {
    if is_url(conninfo) {
        let (scheme, rest) = conninfo.split_once("://").expect("is_url");
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let authority = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => match userinfo.split_once(':') {
                Some((user, _)) => format!("{user}:***@{hosts}"),
                None => format!("{userinfo}@{hosts}"),
            },
            None => authority.to_string(),
        };
        let tail = match tail.split_once('?') {
            Some((path, query)) => {
                let query: Vec<String> = query
                    .split('&')
                    .map(|p| match p.split_once('=') {
                        Some((k @ ("password" | "sslpassword"), _)) => format!("{k}=***"),
                        _ => p.to_string(),
                    })
                    .collect();
                format!("{path}?{}", query.join("&"))
            }
            None => tail.to_string(),
        };
        return format!("{scheme}://{authority}{tail}");
    }
    match key_values(conninfo) {
        Ok(pairs) => pairs
            .into_iter()
            .map(|(k, v)| {
                if k == "password" || k == "sslpassword" {
                    format!("{k}=***")
                } else {
                    format!("{k}={}", quote(&v))
                }
            })
            .collect::<Vec<_>>()
            .join(" "),
        Err(_) => "(an unparsable key=value string, not shown)".into(),
    }
}

/// How messages name a parsed database: its hosts, ports, database and user, never a password.
fn describe(config: &tokio_postgres::Config) -> String {
    use tokio_postgres::config::Host;
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .map(|h| match h {
            Host::Tcp(name) => name.clone(),
            Host::Unix(path) => path.display().to_string(),
        })
        .chain(config.get_hostaddrs().iter().map(|a| a.to_string()))
        .collect();
    let ports: Vec<String> = config.get_ports().iter().map(|p| p.to_string()).collect();
    let mut s = format!("host={}", quote(&hosts.join(",")));
    if !ports.is_empty() {
        s.push_str(&format!(" port={}", ports.join(",")));
    }
    if let Some(db) = config.get_dbname() {
        s.push_str(&format!(" dbname={}", quote(db)));
    }
    if let Some(user) = config.get_user() {
        s.push_str(&format!(" user={}", quote(user)));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn url_with_tls_parameters() {
        let c = parse(
            "postgresql://app:s3cr%40t@db.example:6432/counts?sslmode=verify-full&sslrootcert=/ca.crt&application_name=x",
            &env(&[]),
        )
        .unwrap();
        assert_eq!(c.sslmode, SslMode::VerifyFull);
        assert_eq!(c.files.rootcert, Some(PathBuf::from("/ca.crt")));
        assert_eq!(c.config.get_password(), Some(&b"s3cr@t"[..]));
        assert_eq!(c.config.get_application_name(), Some("x"));
        assert!(c.application_name_set);
        assert_eq!(
            c.redacted,
            "host=db.example port=6432 dbname=counts user=app"
        );
    }

    #[test]
    fn key_values_quoted_and_escaped() {
        let c = parse(
            r"host=/tmp/my\ sock dbname='it\'s' sslmode = require sslkey='/k ey' password=p",
            &env(&[]),
        )
        .unwrap();
        assert_eq!(c.config.get_dbname(), Some("it's"));
        assert_eq!(c.sslmode, SslMode::Require);
        assert_eq!(c.files.key, Some(PathBuf::from("/k ey")));
        assert!(!c.redacted.contains("password"), "{}", c.redacted);
    }

    #[test]
    fn environment_fills_only_what_is_missing() {
        let vars = [
            ("PGSSLMODE", "verify-ca"),
            ("PGHOST", "h1,h2"),
            ("PGPORT", "5433"),
            ("PGUSER", "u"),
            ("PGPASSWORD", "envpw"),
            ("PGAPPNAME", "fromenv"),
        ];
        let c = parse("dbname=d", &env(&vars)).unwrap();
        assert_eq!(c.sslmode, SslMode::VerifyCa);
        assert_eq!(c.config.get_hosts().len(), 2);
        assert_eq!(c.config.get_ports(), &[5433]);
        assert_eq!(c.config.get_password(), Some(&b"envpw"[..]));
        assert!(c.application_name_set);
        let c = parse("host=h sslmode=disable password=mine", &env(&vars)).unwrap();
        assert_eq!(c.sslmode, SslMode::Disable);
        assert_eq!(c.config.get_hosts().len(), 1);
        assert_eq!(c.config.get_password(), Some(&b"mine"[..]));
    }

    #[test]
    fn default_host_is_the_socket_directory() {
        let c = parse("dbname=d", &env(&[])).unwrap();
        assert_eq!(c.redacted, "host=/var/run/postgresql dbname=d");
        assert_eq!(c.sslmode, SslMode::Prefer);
    }

    #[test]
    fn bad_sslmode_is_named() {
        let err = parse("postgres://u:hunter2@h/d?sslmode=verify-some", &env(&[])).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("verify-some"), "{msg}");
        assert!(!msg.contains("hunter2"), "{msg}");
    }

    #[test]
    fn redaction_hides_passwords() {
        assert_eq!(
            redact("postgres://u:hunter2@h:5/d?password=x&sslmode=require"),
            "postgres://u:***@h:5/d?password=***&sslmode=require"
        );
        assert_eq!(redact("postgres://u@h/d"), "postgres://u@h/d");
        assert_eq!(
            redact("host=h password='a b' user=u"),
            "host=h password=*** user=u"
        );
        let err = parse("host=h password=hunter2 bogus=1", &env(&[])).unwrap_err();
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }
}
