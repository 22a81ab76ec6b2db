//! TLS to PostgreSQL with rustls, by libpq's rules: `sslmode` (disable, allow, prefer, require,
//! verify-ca, verify-full), the root certificate that verifies the server (`sslrootcert`, or
//! `system` for the platform's store) and the client certificate (`sslcert`, `sslkey`).
//!
//! As in libpq, a root certificate file that exists turns on chain verification in every mode
//! that uses TLS (so `require` with a root file behaves as `verify-ca`); only `verify-full` also
//! checks that the certificate names the host. Files are read once, when the connection string
//! is parsed, so a missing or unreadable one stops tallyd at startup, not at the first flush.
//!
//! Without a root certificate, `allow`, `prefer` and `require` take any certificate libpq takes
//! there (X.509 version 1 as `CREATE EXTENSION citus` makes, expired, self-signed, any name or
//! extension): the certificate is not parsed beyond its public key, which must still verify the
//! server's handshake signature (docs/design.md, "Connections: TLS, poolers, credentials").

use std::collections::HashMap;
use std::fmt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{
    CertificateDer, PrivateKeyDer, ServerName, SubjectPublicKeyInfoDer, UnixTime,
};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, OtherError, PeerMisbehaved,
    RootCertStore, SignatureScheme,
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

/// A server certificate refused for a reason rustls has no variant for (it travels inside
/// [`CertificateError::Other`]); connect.rs explains it to the user.
#[derive(Debug, thiserror::Error)]
pub enum CertProblem {
    /// webpki verifies only X.509 version 3 certificates (verify-ca, verify-full, or any mode
    /// with a root certificate file).
    #[error("the certificate is X.509 version {0}; only version 3 can be verified")]
    UnsupportedVersion(u8),
    /// The server does not hold the private key of the certificate it sent.
    #[error("the server's handshake signature does not verify with its certificate's key")]
    HandshakeSignature,
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
    Ok(Arc::new(Verified {
        webpki,
        check_name: mode == SslMode::VerifyFull,
    }))
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

/// A root certificate is in use: webpki's verifier, the chain must lead to a trusted root;
/// `verify-full` also checks the host name.
#[derive(Debug)]
struct Verified {
    webpki: Arc<WebPkiServerVerifier>,
    check_name: bool,
}

impl ServerCertVerifier for Verified {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        use rustls::Error::InvalidCertificate;
        // webpki checks the chain first, so a name error means the chain was good.
        match self
            .webpki
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !self.check_name => Ok(ServerCertVerified::assertion()),
            // webpki's UnsupportedCertVersion, which rustls passes on untyped.
            Err(InvalidCertificate(CertificateError::Other(other))) => {
                match Certificate::read(end_entity) {
                    Some(cert) if cert.version < 3 => {
                        Err(refused(CertProblem::UnsupportedVersion(cert.version)))
                    }
                    _ => Err(InvalidCertificate(CertificateError::Other(other))),
                }
            }
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

fn refused(problem: CertProblem) -> rustls::Error {
    rustls::Error::InvalidCertificate(CertificateError::Other(OtherError(Arc::new(problem))))
}

/// `allow`, `prefer` and `require` without a root certificate: encrypted, but the server is not
/// authenticated (libpq's behaviour; the docs say to use verify-full).
///
/// The certificate is taken as it comes: rustls's own signature checks parse it with webpki,
/// which refuses what libpq takes here (X.509 version 1, as `CREATE EXTENSION citus` makes, or
/// an unknown critical extension), so only its public key is read ([`Certificate::read`]).
/// That key must verify the server's handshake signature, as OpenSSL checks under libpq: the
/// server holds the key of the certificate it sent, which is what makes channel binding
/// (SCRAM-SHA-256-PLUS, a hash of that certificate) worth anything.
#[derive(Debug)]
struct NoVerify(Arc<CryptoProvider>);

impl NoVerify {
    fn algorithms(&self) -> &WebPkiSupportedAlgorithms {
        &self.0.signature_verification_algorithms
    }
}

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

    /// TLS 1.2 names the hash and signature but not the curve, so each algorithm of the scheme
    /// whose key type matches the certificate's is a candidate (as rustls does); the first decides.
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let candidates = self
            .algorithms()
            .mapping
            .iter()
            .find(|(scheme, _)| *scheme == dss.scheme)
            .map(|(_, algs)| *algs)
            .ok_or(PeerMisbehaved::SignedHandshakeWithUnadvertisedSigScheme)?;
        let (key_algorithm, key) = Certificate::read(cert)
            .and_then(|c| c.public_key())
            .ok_or(CertificateError::BadEncoding)?;
        let alg = candidates
            .iter()
            .find(|alg| alg.public_key_alg_id().as_ref() == key_algorithm)
            .ok_or_else(
                || CertificateError::UnsupportedSignatureAlgorithmForPublicKeyContext {
                    signature_algorithm_id: candidates
                        .first()
                        .map(|a| a.signature_alg_id().as_ref().to_vec())
                        .unwrap_or_default(),
                    public_key_algorithm_id: key_algorithm.to_vec(),
                },
            )?;
        alg.verify_signature(key, message, dss.signature())
            .map_err(|_| refused(CertProblem::HandshakeSignature))?;
        Ok(HandshakeSignatureValid::assertion())
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let spki = Certificate::read(cert).ok_or(CertificateError::BadEncoding)?;
        rustls::crypto::verify_tls13_signature_with_raw_key(
            message,
            &SubjectPublicKeyInfoDer::from(spki.spki),
            dss,
            self.algorithms(),
        )
        .map_err(|err| match err {
            rustls::Error::InvalidCertificate(CertificateError::BadSignature) => {
                refused(CertProblem::HandshakeSignature)
            }
            other => other,
        })
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms().supported_schemes()
    }
}

/// The two fields of an X.509 certificate that tallyd reads itself: the version and the
/// SubjectPublicKeyInfo. A short walk over the DER that steps over everything else (serial,
/// names, validity, extensions) without looking inside, so that whatever libpq takes is read.
struct Certificate<'a> {
    /// 1, 2 or 3 (the encoded value plus one).
    version: u8,
    /// The whole SubjectPublicKeyInfo element.
    spki: &'a [u8],
}

const INTEGER: u8 = 0x02;
const BIT_STRING: u8 = 0x03;
const SEQUENCE: u8 = 0x30;
/// `[0] EXPLICIT`: the version field of TBSCertificate.
const CONTEXT_0: u8 = 0xa0;

impl<'a> Certificate<'a> {
    fn read(der: &'a [u8]) -> Option<Certificate<'a>> {
        let (_, certificate, _) = der_element(der, Some(SEQUENCE))?;
        let (_, tbs, _) = der_element(certificate, Some(SEQUENCE))?;
        let (version, mut rest) = match der_element(tbs, Some(CONTEXT_0)) {
            Some((_, explicit, rest)) => match der_element(explicit, Some(INTEGER))? {
                (_, [v], _) => (v.checked_add(1)?, rest),
                _ => return None,
            },
            // DEFAULT v1: absent in a version 1 certificate.
            None => (1, tbs),
        };
        // serialNumber, signature, issuer, validity, subject.
        for _ in 0..5 {
            rest = der_element(rest, None)?.2;
        }
        let (spki, _, _) = der_element(rest, Some(SEQUENCE))?;
        Some(Certificate { version, spki })
    }

    /// The key's AlgorithmIdentifier (its contents, as `public_key_alg_id` gives them) and the
    /// key itself (the BIT STRING's bits).
    fn public_key(&self) -> Option<(&'a [u8], &'a [u8])> {
        let (_, spki, _) = der_element(self.spki, Some(SEQUENCE))?;
        let (_, algorithm, rest) = der_element(spki, Some(SEQUENCE))?;
        let (_, bits, _) = der_element(rest, Some(BIT_STRING))?;
        match bits.split_first()? {
            (0, key) => Some((algorithm, key)),
            _ => None,
        }
    }
}

/// The DER element at the start of `input`, of tag `tag` when given: (the whole element, its
/// contents, what follows it). Single-byte tags and definite lengths only, as DER has here.
fn der_element(input: &[u8], tag: Option<u8>) -> Option<(&[u8], &[u8], &[u8])> {
    let (&found, rest) = input.split_first()?;
    if tag.is_some_and(|t| t != found) || found & 0x1f == 0x1f {
        return None;
    }
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = match first {
        0..=0x7f => (usize::from(first), rest),
        0x81..=0x84 => {
            let (bytes, rest) = rest.split_at_checked(usize::from(first & 0x7f))?;
            let len = bytes
                .iter()
                .fold(0usize, |len, &b| (len << 8) | usize::from(b));
            (len, rest)
        }
        _ => return None,
    };
    let (contents, after) = rest.split_at_checked(len)?;
    let header = input.len() - rest.len();
    Some((&input[..header + len], contents, after))
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

    /// Self-signed, P-256, expired (valid for zero days), made by `openssl x509 -req`: without
    /// extensions (X.509 version 1), and with a critical CA constraint and a critical extension
    /// nobody knows (version 3), both on the key of [`KEY`].
    const V1: &str = "-----BEGIN CERTIFICATE-----
MIIBATCBqAIBATAKBggqhkjOPQQDAjANMQswCQYDVQQDDAJ2MTAeFw0yNjExMjUw
OTAzMjRaFw0yNjExMjUwOTAzMjRaMA0xCzAJBgNVBAMMAnYxMFkwEwYHKoZIzj0C
AQYIKoZIzj0DAQcDQgAE7KJEFbhSI8tYYVMAltxfmAqYICitYE2yY1WZkzzew0/K
3ezbsPhOmhWwkClfvjpDUlkxv/k29Ga/qqd7tM1PDTAKBggqhkjOPQQDAgNIADBF
AiBFB143sBOiwFegSHzOcL0tc/tdUqgV9AJFNsn+GT9+uQIhAMDq9VbvFHzeC/5q
GJyaFNsHMWPb9PITQu14j8V4qNw3
-----END CERTIFICATE-----";
    const V3: &str = "-----BEGIN CERTIFICATE-----
MIIBVTCB/KADAgECAgECMAoGCCqGSM49BAMCMA0xCzAJBgNVBAMMAnYxMB4XDTI2
MTEyNTA5MDMyN1oXDTI2MTEyNTA5MDMyN1owDTELMAkGA1UEAwwCdjEwWTATBgcq
hkjOPQIBBggqhkjOPQMBBwNCAATsokQVuFIjy1hhUwCW3F+YCpggKK1gTbJjVZmT
PN7DT8rd7Nuw+E6aFbCQKV++OkNSWTG/+Tb0Zr+qp3u0zU8No00wSzAPBgNVHRMB
Af8EBTADAQH/MBkGCSsGAQQBho0fAQEB/wQJDAd1bmtub3duMB0GA1UdDgQWBBRO
szFgsTAKH9/G3kz4uKP3+5r9LDAKBggqhkjOPQQDAgNIADBFAiBmevygkybNTtQ/
CHFcUCELvHFED/IoMJJaSUeFneEp9QIhAIrdW/3bl0LB2rX6U65cKyDrYvNUfrPM
rn/ctZy24Z5b
-----END CERTIFICATE-----";
    /// `openssl x509 -noout -pubkey` of both: the SubjectPublicKeyInfo.
    const KEY: &str = "-----BEGIN PUBLIC KEY-----
MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE7KJEFbhSI8tYYVMAltxfmAqYICit
YE2yY1WZkzzew0/K3ezbsPhOmhWwkClfvjpDUlkxv/k29Ga/qqd7tM1PDQ==
-----END PUBLIC KEY-----";

    fn der(pem: &str) -> CertificateDer<'static> {
        CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
    }

    #[test]
    fn a_certificate_of_any_version_gives_its_public_key() {
        let key = SubjectPublicKeyInfoDer::from_pem_slice(KEY.as_bytes()).unwrap();
        for (pem, version) in [(V1, 1), (V3, 3)] {
            let der = der(pem);
            let cert = Certificate::read(&der).unwrap();
            assert_eq!(cert.version, version);
            assert_eq!(cert.spki, key.as_ref());
            let (algorithm, bits) = cert.public_key().unwrap();
            // id-ecPublicKey with prime256v1, and an uncompressed point.
            assert_eq!(
                algorithm,
                rustls::pki_types::alg_id::ECDSA_P256.as_ref(),
                "{version}"
            );
            assert_eq!((bits.len(), bits[0]), (65, 0x04));
        }
    }

    #[test]
    fn a_truncated_certificate_or_a_bad_length_is_not_read() {
        let der = der(V3);
        for len in 0..der.len() {
            assert!(Certificate::read(&der[..len]).is_none(), "{len}");
        }
        // A length longer than the input, and a length of more than four bytes.
        assert!(der_element(&[0x30, 0x82, 0xff, 0xff, 0], None).is_none());
        assert!(der_element(&[0x30, 0x85, 0, 0, 0, 0, 1, 0], None).is_none());
        assert_eq!(
            der_element(&[0x02, 0x01, 0x07, 0xff], Some(0x02)),
            Some((&[0x02, 0x01, 0x07][..], &[0x07][..], &[0xff][..]))
        );
        assert!(der_element(&[0x02, 0x01, 0x07], Some(0x30)).is_none());
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
