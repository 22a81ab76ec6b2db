//! TLS to PostgreSQL with rustls, by libpq's rules: `sslmode` (disable, allow, prefer, require,
//! verify-ca, verify-full), the root certificate that verifies the server (`sslrootcert`, or
//! `system` for the platform's store) and the client certificate (`sslcert`, `sslkey`).
//!
//! As in libpq, a root certificate file that exists turns on chain verification in every mode
//! that uses TLS (so `require` with a root file behaves as `verify-ca`); only `verify-full` also
//! checks that the certificate names the host. Files are read once, when the connection string
//! is parsed, so a missing or unreadable one stops tallyd at startup, not at the first flush.

use std::collections::HashMap;
use std::fmt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio_postgres_rustls::MakeRustlsConnect;

/// libpq's `sslmode`.
/// Ordered from weakest to strongest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SslMode {
    Disable,
    Allow,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl FromStr for SslMode {
    type Err = String;
    fn from_str(s: &str) -> Result<SslMode, String> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(format!(
                    "invalid sslmode value \"{other}\" (expected disable, allow, prefer, require, \
                     verify-ca or verify-full)"
                ))
            }
        })
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        })
    }
}

/// The certificate files a connection string names, and libpq's defaults under `~/.postgresql/`.
#[derive(Clone, Debug, Default)]
pub struct TlsFiles {
    pub rootcert: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    home: Option<PathBuf>,
}

impl TlsFiles {
    pub fn new(own: &HashMap<String, String>, home: Option<&Path>) -> TlsFiles {
        let path = |k: &str| own.get(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        TlsFiles {
            rootcert: path("sslrootcert"),
            cert: path("sslcert"),
            key: path("sslkey"),
            home: home.map(Path::to_path_buf),
        }
    }

    fn default_file(&self, name: &str) -> Option<PathBuf> {
        self.home.as_ref().map(|h| h.join(".postgresql").join(name))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error(
        "root certificate file {} does not exist; either provide the file (sslrootcert) or \
         change sslmode to disable server certificate verification", path.display()
    )]
    NoRootCert { path: PathBuf },
    #[error("cannot read {what} {}: {cause}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("{what} {} holds no PEM {kind}", path.display())]
    Empty {
        what: &'static str,
        path: PathBuf,
        kind: &'static str,
    },
    #[error(
        "private key file {} has group or world access; file must have permissions u=rw (0600) \
         or less if owned by the current user, or u=rw,g=r (0640) or less if owned by root",
        path.display()
    )]
    KeyPermissions { path: PathBuf },
    #[error("weak sslmode \"{0}\" may not be used with sslrootcert=system (use \"verify-full\")")]
    WeakWithSystem(SslMode),
    #[error("no certificates found in the system store")]
    NoSystemRoots,
    #[error("TLS setup: {0}")]
    Rustls(rustls::Error),
}

// By hand rather than `#[from]`, which would also make it the `source()`: printed twice.
impl From<rustls::Error> for TlsError {
    fn from(err: rustls::Error) -> TlsError {
        TlsError::Rustls(err)
    }
}

/// The connector for `mode` and `files`; `None` with `sslmode=disable`.
pub fn connector(
    mode: SslMode,
    files: &TlsFiles,
    sni: bool,
) -> Result<Option<MakeRustlsConnect>, TlsError> {
    if mode == SslMode::Disable {
        return Ok(None);
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = verifier(mode, files, &provider)?;
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let mut config = match client_identity(files)? {
        Some((certs, key)) => builder.with_client_auth_cert(certs, key)?,
        None => builder.with_no_client_auth(),
    };
    config.enable_sni = sni;
    // PostgreSQL 17 insists on its ALPN name for direct TLS; older servers ignore it.
    config.alpn_protocols = vec![b"postgresql".to_vec()];
    Ok(Some(MakeRustlsConnect::new(config)))
}

fn verifier(
    mode: SslMode,
    files: &TlsFiles,
    provider: &Arc<CryptoProvider>,
) -> Result<Arc<dyn ServerCertVerifier>, TlsError> {
    let roots = if files.rootcert.as_deref() == Some(Path::new("system")) {
        if mode != SslMode::VerifyFull {
            return Err(TlsError::WeakWithSystem(mode));
        }
        Some(system_roots()?)
    } else {
        let explicit = files.rootcert.clone();
        let path = explicit.clone().or_else(|| files.default_file("root.crt"));
        match path {
            Some(p) if p.exists() => Some(read_roots(&p)?),
            Some(p) if matches!(mode, SslMode::VerifyCa | SslMode::VerifyFull) => {
                return Err(TlsError::NoRootCert { path: p })
            }
            None if matches!(mode, SslMode::VerifyCa | SslMode::VerifyFull) => {
                return Err(TlsError::NoRootCert {
                    path: PathBuf::from("~/.postgresql/root.crt"),
                })
            }
            Some(p) if explicit.is_some() => return Err(TlsError::NoRootCert { path: p }),
            _ => None,
        }
    };
    let Some(roots) = roots else {
        return Ok(Arc::new(NoVerify(provider.clone())));
    };
    let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| TlsError::Rustls(rustls::Error::General(e.to_string())))?;
    Ok(if mode == SslMode::VerifyFull {
        webpki
    } else {
        Arc::new(ChainOnly(webpki))
    })
}

fn read_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let certs = read_certs("root certificate file", path)?;
    let mut roots = RootCertStore::empty();
    let (_, ignored) = roots.add_parsable_certificates(certs);
    if roots.is_empty() {
        return Err(TlsError::Empty {
            what: "root certificate file",
            path: path.into(),
            kind: "certificate usable as a CA",
        });
    }
    if ignored > 0 {
        tracing::warn!(file = %path.display(), ignored, "some certificates in sslrootcert could not be used");
    }
    Ok(roots)
}

fn system_roots() -> Result<RootCertStore, TlsError> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    roots.add_parsable_certificates(found.certs);
    if roots.is_empty() {
        return Err(TlsError::NoSystemRoots);
    }
    Ok(roots)
}

fn read_certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.into(),
        cause: source,
    })?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&bytes)
        .filter_map(Result::ok)
        .collect();
    if certs.is_empty() {
        return Err(TlsError::Empty {
            what,
            path: path.into(),
            kind: "certificate",
        });
    }
    Ok(certs)
}

type Identity = (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

/// The client certificate and its key: `sslcert`/`sslkey`, else `~/.postgresql/postgresql.crt`
/// and `.key` when they exist. An explicitly named file that is missing is an error (libpq
/// would silently send no certificate).
fn client_identity(files: &TlsFiles) -> Result<Option<Identity>, TlsError> {
    let cert_path = match (&files.cert, files.default_file("postgresql.crt")) {
        (Some(p), _) => p.clone(),
        (None, Some(p)) if p.exists() => p,
        _ => return Ok(None),
    };
    let certs = read_certs("client certificate file", &cert_path)?;
    let key_path = files
        .key
        .clone()
        .or_else(|| files.default_file("postgresql.key"))
        .unwrap_or_else(|| cert_path.with_extension("key"));
    let meta = std::fs::metadata(&key_path).map_err(|source| TlsError::Read {
        what: "private key file",
        path: key_path.clone(),
        cause: source,
    })?;
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let loose = (meta.uid() == euid && meta.mode() & 0o077 != 0)
        || (meta.uid() == 0 && meta.mode() & 0o037 != 0);
    if loose {
        return Err(TlsError::KeyPermissions { path: key_path });
    }
    let bytes = std::fs::read(&key_path).map_err(|source| TlsError::Read {
        what: "private key file",
        path: key_path.clone(),
        cause: source,
    })?;
    let key = PrivateKeyDer::from_pem_slice(&bytes).map_err(|_| TlsError::Empty {
        what: "private key file",
        path: key_path,
        kind: "private key (PKCS#8, PKCS#1 or SEC1, unencrypted)",
    })?;
    Ok(Some((certs, key)))
}

/// `verify-ca`: the chain must lead to a trusted root; the host name is not checked.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        // webpki checks the chain first, so a name error means the chain was good.
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `allow`, `prefer` and `require` without a root certificate: encrypted, but the server is not
/// authenticated (libpq's behaviour; the docs say to use verify-full).
#[derive(Debug)]
struct NoVerify(Arc<CryptoProvider>);

impl ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sslmode_parses_every_libpq_value() {
        for m in [
            "disable",
            "allow",
            "prefer",
            "require",
            "verify-ca",
            "verify-full",
        ] {
            assert_eq!(m.parse::<SslMode>().unwrap().to_string(), m);
        }
        assert!("verify"
            .parse::<SslMode>()
            .unwrap_err()
            .contains("verify-full"));
    }

    #[test]
    fn verification_needs_a_root_certificate() {
        let files = TlsFiles {
            rootcert: Some("/nonexistent/ca.crt".into()),
            ..TlsFiles::default()
        };
        let err = connector(SslMode::VerifyFull, &files, true).err().unwrap();
        assert!(matches!(err, TlsError::NoRootCert { .. }), "{err}");
        assert!(connector(SslMode::Require, &TlsFiles::default(), true)
            .unwrap()
            .is_some());
        assert!(connector(SslMode::Disable, &files, true).unwrap().is_none());
        let system = TlsFiles {
            rootcert: Some("system".into()),
            ..TlsFiles::default()
        };
        assert!(matches!(
            connector(SslMode::Require, &system, true).err().unwrap(),
            TlsError::WeakWithSystem(SslMode::Require)
        ));
    }
}
