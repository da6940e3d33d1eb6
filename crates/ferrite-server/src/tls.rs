//! TLS for every listener (`--tls-cert`, `--tls-key`), and mutual TLS when `--tls-client-ca` is
//! given: a client must then present a certificate signed by that CA. rustls with the `ring`
//! provider; PEM files only.

use std::{path::PathBuf, sync::Arc};

use tokio_rustls::rustls::{
    self,
    pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer},
    server::WebPkiClientVerifier,
    RootCertStore,
};

#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Clients must present a certificate signed by this CA (mutual TLS).
    pub client_ca: Option<PathBuf>,
}

/// The PEM contents of the files, read once at start-up.
#[derive(Clone)]
pub struct Tls {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("Tls").field("mutual", &self.client_ca.is_some()).finish()
    }
}

fn read(path: &PathBuf, what: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{what} {}: {e}", path.display()))
}

impl Tls {
    /// Reads the files and checks that they make a working configuration.
    pub fn load(files: &TlsFiles) -> Result<Tls, String> {
        let tls = Tls {
            cert: read(&files.cert, "--tls-cert")?,
            key: read(&files.key, "--tls-key")?,
            client_ca: files.client_ca.as_ref().map(|p| read(p, "--tls-client-ca")).transpose()?,
        };
        tls.acceptor()?;
        Ok(tls)
    }

    pub fn is_mutual(&self) -> bool {
        self.client_ca.is_some()
    }

    /// The acceptor for the HTTP and metrics listeners (ALPN: h2, http/1.1).
    pub fn acceptor(&self) -> Result<tokio_rustls::TlsAcceptor, String> {
        let certs = CertificateDer::pem_slice_iter(&self.cert)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("--tls-cert: {e}"))?;
        if certs.is_empty() {
            return Err("--tls-cert holds no certificate".into());
        }
        let key = PrivateKeyDer::from_pem_slice(&self.key).map_err(|e| format!("--tls-key: {e}"))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = RootCertStore::empty();
                for c in CertificateDer::pem_slice_iter(ca) {
                    roots.add(c.map_err(|e| format!("--tls-client-ca: {e}"))?).map_err(|e| e.to_string())?;
                }
                let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                    .build()
                    .map_err(|e| format!("--tls-client-ca: {e}"))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_single_cert(certs, key).map_err(|e| format!("--tls-cert/--tls-key: {e}"))?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
    }

    /// The same configuration for the gRPC listener.
    pub fn grpc(&self) -> tonic::transport::ServerTlsConfig {
        let config = tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(&self.cert, &self.key));
        match &self.client_ca {
            Some(ca) => config.client_ca_root(tonic::transport::Certificate::from_pem(ca)),
            None => config,
        }
    }
}
