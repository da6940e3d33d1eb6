//! Triton's system shared-memory extension: a client on this host registers a POSIX shared-memory
//! object (`shm_open`'s key) under a region name, then names the region, an offset and a byte
//! size in an input's or a requested output's parameters (`shared_memory_region`,
//! `shared_memory_offset`, `shared_memory_byte_size`); the tensor's bytes are read from there
//! instead of the request, and an output's written there instead of the response.
//!
//! Off unless `--shared-memory system`: a registration opens any shared-memory object this
//! process may open, so only clients trusted with this host's shared memory should reach it.
//! Regions are read and written through their descriptor (`pread`/`pwrite`), never mapped: a
//! client that shrinks its object under the server gets an error, not a SIGBUS that would end
//! the process. A region's names are its tenant's: another tenant can neither see, use nor
//! unregister it, nor register the object it holds under a region of its own.

use std::{
    fs::File,
    os::unix::fs::{FileExt, MetadataExt},
    sync::{Arc, Mutex},
};

use crate::budget::{Budget, Reserved};
use bytes::Bytes;
use ferrite_core::{wire::Param, DataType, Error, Tensor, TensorData};
use std::sync::atomic::Ordering::Relaxed;

/// Regions one server holds at most: each holds a file descriptor, so an eighth of the open-files
/// limit (connections may take three quarters of it), 16 to 1024.
fn max_regions() -> usize {
    (crate::http::libc_rlimit_nofile() / 8).clamp(16, 1024)
}

/// Where a tensor lies in a region, as its parameters say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    pub region: String,
    pub offset: u64,
    pub byte_size: u64,
}

impl Place {
    /// The place a tensor's parameters name, if they name one: `shared_memory_region` with
    /// `shared_memory_byte_size` (and `shared_memory_offset`, 0 when absent).
    pub fn of<'a>(tensor: &str, get: impl Fn(&str) -> Option<Param<'a>>) -> Result<Option<Place>, Error> {
        let unsigned =
            |key: &str| ferrite_core::wire::unsigned(&get, key).map_err(|e| Error::invalid(format!("'{tensor}': {e}")));
        let region = match get("shared_memory_region") {
            None => {
                if get("shared_memory_byte_size").is_some() || get("shared_memory_offset").is_some() {
                    return Err(Error::invalid(format!(
                        "'{tensor}': shared_memory_byte_size and shared_memory_offset need shared_memory_region"
                    )));
                }
                return Ok(None);
            }
            Some(Param::Str(s)) => s.to_string(),
            Some(_) => return Err(Error::invalid(format!("'{tensor}': shared_memory_region must be a string"))),
        };
        let byte_size = unsigned("shared_memory_byte_size")?
            .ok_or_else(|| Error::invalid(format!("'{tensor}': shared_memory_region needs shared_memory_byte_size")))?;
        Ok(Some(Place { region, offset: unsigned("shared_memory_offset")?.unwrap_or(0), byte_size }))
    }
}

/// A registered region: `byte_size` bytes of the object `key` from `offset`, `tenant`'s.
#[derive(Debug)]
pub struct Region {
    pub name: String,
    pub key: String,
    pub offset: u64,
    pub byte_size: u64,
    tenant: Option<String>,
    /// The share it counts in (`register`).
    share: Option<String>,
    /// The object's device and inode: what another key naming it (`x`, `/x`) names too.
    object: (u64, u64),
    file: File,
}

impl Region {
    fn is(&self, tenant: Option<&str>, name: &str) -> bool {
        self.tenant.as_deref() == tenant && self.name == name
    }
}

/// The regions registered on this server. A few at most as a rule, and at most `max_regions`: a
/// list looked through, which no lookup allocates for.
#[derive(Debug)]
pub struct Regions {
    enabled: bool,
    max_regions: usize,
    /// Bytes one request may read (the body limit).
    max_bytes: usize,
    /// The bytes all requests may hold at once, shared with the bodies being read: a read holds
    /// its share until its tensor is dropped.
    budget: Arc<Budget>,
    regions: Mutex<Vec<Arc<Region>>>,
}

impl Regions {
    /// `max_bytes`: what one request may read; `budget`: the bodies' budget.
    pub fn new(enabled: bool, max_bytes: usize, budget: Arc<Budget>) -> Regions {
        Regions { enabled, max_regions: max_regions(), max_bytes, budget, regions: Mutex::new(Vec::new()) }
    }

    /// The protocol extensions the server metadata lists: the core's, and this one when on.
    pub fn extensions(&self) -> Vec<String> {
        let on = self.enabled.then_some("system_shared_memory");
        ferrite_core::wire::EXTENSIONS.iter().copied().chain(on).map(str::to_string).collect()
    }

    pub fn off() -> Error {
        Error::Unsupported("system shared memory is off on this server (start it with --shared-memory system)".into())
    }

    fn taken(name: &str) -> Error {
        Error::invalid(format!("shared memory region '{name}' is already registered"))
    }

    /// Registers `name` for `tenant`, of `share` (`auth::share`): `byte_size` bytes of the
    /// shared-memory object `key` from `offset`, which must lie within the object now.
    pub fn register(
        &self,
        tenant: Option<&str>,
        share: Option<&str>,
        name: &str,
        key: &str,
        offset: u64,
        byte_size: u64,
    ) -> Result<(), Error> {
        if !self.enabled {
            return Err(Self::off());
        }
        if name.is_empty() || name.len() > 256 {
            return Err(Error::invalid("a region's name must have 1 to 256 bytes"));
        }
        if self.lock().iter().any(|r| r.is(tenant, name)) {
            return Err(Self::taken(name));
        }
        let file = open(key)?;
        let meta = file.metadata().map_err(|e| Error::invalid(format!("shared memory key '{key}': {e}")))?;
        let (size, object) = (meta.len(), (meta.dev(), meta.ino()));
        if offset.checked_add(byte_size).is_none_or(|end| end > size) {
            return Err(Error::invalid(format!(
                "shared memory region '{name}': offset {offset} and byte_size {byte_size} go past the {size} bytes of '{key}'"
            )));
        }
        let mut regions = self.lock();
        if regions.len() >= self.max_regions {
            let message =
                format!("{} shared memory regions are registered, the most this server holds", self.max_regions);
            return Err(Error::Overloaded { message, retry_after: None });
        }
        // A share (a tenant's; where tenants are configured, also the one of requests acting for
        // none, or for names they made up: `auth::share`) holds a quarter of them at most, so no
        // one tenant leaves the others none.
        let most = self.max_regions / 4;
        if share.is_some() && regions.iter().filter(|r| r.share.as_deref() == share).count() >= most {
            let whose = match share {
                Some(crate::auth::OTHERS) => "requests acting for no tenant of their own hold",
                _ => "this tenant holds",
            };
            let message = format!("{whose} {most} shared memory regions, the most one share may");
            return Err(Error::Overloaded { message, retry_after: None });
        }
        // Opened unlocked: another call may have registered the name meanwhile.
        if regions.iter().any(|r| r.is(tenant, name)) {
            return Err(Self::taken(name));
        }
        // An object one tenant's regions hold is not another's to read or write through this
        // server (whose access to the host's shared memory is wider than a client's may be).
        if regions.iter().any(|r| r.object == object && r.tenant.as_deref() != tenant) {
            return Err(Error::invalid(format!("shared memory key '{key}' is registered by another tenant")));
        }
        let (tenant, share) = (tenant.map(str::to_string), share.map(str::to_string));
        regions.push(Arc::new(Region {
            name: name.to_string(),
            key: key.to_string(),
            offset,
            byte_size,
            tenant,
            share,
            object,
            file,
        }));
        Ok(())
    }

    /// Unregisters `tenant`'s region `name`, or all of its regions when `name` is empty; a name
    /// not registered is no error (as Triton).
    pub fn unregister(&self, tenant: Option<&str>, name: &str) {
        self.lock().retain(|r| r.tenant.as_deref() != tenant || (!name.is_empty() && r.name != name));
    }

    /// `tenant`'s region `name`, or all of its regions (by name) when `name` is empty.
    pub fn status(&self, tenant: Option<&str>, name: &str) -> Result<Vec<Arc<Region>>, Error> {
        if !name.is_empty() {
            return self.get(tenant, name).map(|r| vec![r]);
        }
        let mut all: Vec<_> = self.lock().iter().filter(|r| r.tenant.as_deref() == tenant).cloned().collect();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(all)
    }

    fn get(&self, tenant: Option<&str>, name: &str) -> Result<Arc<Region>, Error> {
        let found = self.lock().iter().find(|r| r.is(tenant, name)).cloned();
        found.ok_or_else(|| match self.enabled {
            true => Error::NotFound(format!("no shared memory region '{name}' is registered")),
            false => Self::off(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Region>>> {
        self.regions.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Opens a POSIX shared-memory object by its key (`/name`, as `shm_open` takes it): only such
/// objects, never a path to another file.
fn open(key: &str) -> Result<File, Error> {
    use std::os::fd::FromRawFd;
    let name = key.strip_prefix('/').unwrap_or(key);
    if name.is_empty() || name.len() > 255 || name.contains('/') || name.contains('\0') || name == "." || name == ".." {
        return Err(Error::invalid(format!("shared memory key '{key}' is not a POSIX shared memory name")));
    }
    let c = std::ffi::CString::new(format!("/{name}")).expect("no NUL in the name");
    // SAFETY: `c` is a valid C string; the descriptor returned is owned by the File made of it.
    let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return Err(Error::invalid(format!("cannot open shared memory key '{key}': {e}")));
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// One request's way to the regions: its tenant's, and at most the body limit read in all (held
/// in its share of the budget).
pub struct Access {
    regions: Arc<Regions>,
    tenant: Option<String>,
    share: Option<String>,
    read: std::sync::atomic::AtomicUsize,
}

/// A tensor's bytes read from shared memory, holding their share of the budget while they live.
struct Reading<B> {
    bytes: B,
    _reserved: Reserved,
}

impl<B: AsRef<[u8]>> AsRef<[u8]> for Reading<B> {
    fn as_ref(&self) -> &[u8] {
        self.bytes.as_ref()
    }
}

impl Access {
    pub fn new(regions: Arc<Regions>, tenant: Option<String>, share: Option<String>) -> Access {
        Access { regions, tenant, share, read: Default::default() }
    }

    /// Where, within its region's object, `place`'s bytes lie, checked against the region.
    fn locate(&self, tensor: &str, place: &Place) -> Result<(Arc<Region>, u64), Error> {
        let region = self.regions.get(self.tenant.as_deref(), &place.region)?;
        if place.offset.checked_add(place.byte_size).is_none_or(|end| end > region.byte_size) {
            return Err(Error::invalid(format!(
                "'{tensor}': offset {} and byte_size {} go past the {} bytes of shared memory region '{}'",
                place.offset, place.byte_size, region.byte_size, place.region
            )));
        }
        Ok((region.clone(), region.offset + place.offset))
    }

    /// An input's data, `count` elements of `datatype`, read from its place.
    pub fn read(&self, input: &str, place: &Place, datatype: DataType, count: usize) -> Result<TensorData, Error> {
        let size = usize::try_from(place.byte_size).unwrap_or(usize::MAX);
        // A fixed-size type's bytes are its count's (checked within the request's element limit);
        // BYTES elements are length-prefixed. All of a request's reads: within the body limit.
        let bound = datatype.size().map_or(usize::MAX, |s| count.saturating_mul(s));
        if size > bound {
            return Err(Error::invalid(format!(
                "input '{input}': shared_memory_byte_size {size} is more than its {bound} bytes"
            )));
        }
        let total = self.read.fetch_add(size, Relaxed).saturating_add(size);
        if total > self.regions.max_bytes {
            return Err(Error::invalid(format!(
                "input '{input}': the request's inputs in shared memory are over {} bytes (--max-body-bytes)",
                self.regions.max_bytes
            )));
        }
        let (region, at) = self.locate(input, place)?;
        let reserved = self.regions.budget.take(self.share.as_deref(), size).ok_or_else(|| Error::Unavailable {
            message: "too many request bytes in flight on this server; retry shortly".into(),
            retry_after: Some(std::time::Duration::from_secs(1)),
        })?;
        let failed = |e: std::io::Error| {
            Error::invalid(format!("input '{input}': cannot read shared memory region '{}': {e}", place.region))
        };
        // Large reads go to the pooled buffers large bodies use: a fresh one would be a fresh
        // mapping, a page fault per 4 KiB written.
        let data = if size >= crate::http::pool::POOLED_FROM {
            let buf = crate::http::pool::BODIES.filled(size, |b| region.file.read_exact_at(b, at)).map_err(failed)?;
            Bytes::from_owner(Reading { bytes: buf, _reserved: reserved })
        } else {
            let mut buf = vec![0; size];
            region.file.read_exact_at(&mut buf, at).map_err(failed)?;
            Bytes::from_owner(Reading { bytes: buf, _reserved: reserved })
        };
        TensorData::from_wire(input, datatype, count, data)
    }

    /// The bytes read so far for its request (charged to the budget while their tensors live).
    pub fn bytes_read(&self) -> usize {
        self.read.load(Relaxed)
    }

    /// Writes an output's bytes to its place; their length.
    pub fn write(&self, output: &Tensor, place: &Place) -> Result<u64, Error> {
        let name = &output.name;
        let (region, at) = self.locate(name, place)?;
        let bytes = output.data.to_wire();
        if bytes.len() as u64 > place.byte_size {
            return Err(Error::invalid(format!(
                "output '{name}': its {} bytes do not fit the {} of shared_memory_byte_size",
                bytes.len(),
                place.byte_size
            )));
        }
        region.file.write_all_at(&bytes, at).map_err(|e| {
            Error::invalid(format!("output '{name}': cannot write shared memory region '{}': {e}", place.region))
        })?;
        Ok(bytes.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shared-memory object of `size` bytes, unlinked when dropped.
    struct Object(String);
    impl Object {
        fn new(size: usize) -> Object {
            static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let key = format!("/ferrite-test-{}-{n}", std::process::id());
            let c = std::ffi::CString::new(key.clone()).unwrap();
            // SAFETY: a valid C string; the descriptor is owned by the File.
            let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600) };
            assert!(fd >= 0, "{}", std::io::Error::last_os_error());
            let f = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
            f.set_len(size as u64).unwrap();
            Object(key)
        }
        fn file(&self) -> File {
            open(&self.0).unwrap()
        }
    }
    impl Drop for Object {
        fn drop(&mut self) {
            let c = std::ffi::CString::new(self.0.clone()).unwrap();
            unsafe { libc::shm_unlink(c.as_ptr()) };
        }
    }

    fn budget() -> Arc<Budget> {
        Budget::new(1 << 30)
    }

    fn access(regions: &Arc<Regions>, tenant: Option<&str>) -> Access {
        Access::new(regions.clone(), tenant.map(str::to_string), tenant.map(str::to_string))
    }

    fn place(region: &str, offset: u64, byte_size: u64) -> Place {
        Place { region: region.into(), offset, byte_size }
    }

    #[test]
    fn inputs_are_read_and_outputs_written_within_their_regions_only() {
        let obj = Object::new(64);
        obj.file().write_all_at(&[1, 0, 0, 0, 2, 0, 0, 0], 16).unwrap();
        let regions = Arc::new(Regions::new(true, 1 << 20, budget()));
        regions.register(None, None, "r", &obj.0, 8, 32).unwrap();
        let a = access(&regions, None);
        let data = a.read("x", &place("r", 8, 8), DataType::Int32, 2).unwrap();
        assert_eq!(data.to_wire().as_ref(), &[1, 0, 0, 0, 2, 0, 0, 0]);
        // Past the region (not the object): refused; a size that is not the tensor's: refused.
        let e = a.read("x", &place("r", 28, 8), DataType::Int32, 2).unwrap_err().to_string();
        assert!(e.contains("go past the 32 bytes"), "{e}");
        assert!(a.read("x", &place("r", 0, 12), DataType::Int32, 2).is_err());
        assert!(a.read("x", &place("r", u64::MAX, 8), DataType::Int32, 2).is_err());
        let out = Tensor::new("y", DataType::Int32, vec![1], TensorData::Fixed(Bytes::from_static(&[7, 0, 0, 0])));
        assert_eq!(a.write(&out, &place("r", 4, 4)).unwrap(), 4);
        let mut back = [0; 4];
        obj.file().read_exact_at(&mut back, 12).unwrap();
        assert_eq!(back, [7, 0, 0, 0]);
        let e = a.write(&out, &place("r", 0, 2)).unwrap_err().to_string();
        assert!(e.contains("do not fit"), "{e}");
        // A region past its object, a name taken, a key that is a path: refused.
        assert!(regions.register(None, None, "big", &obj.0, 0, 65).is_err());
        assert!(regions.register(None, None, "r", &obj.0, 0, 8).is_err());
        assert!(regions.register(None, None, "p", "/../etc/passwd", 0, 8).is_err());
        assert!(regions.register(None, None, "p", "/dev/shm/x", 0, 8).is_err());
    }

    #[test]
    fn a_region_shrunk_under_the_server_fails_its_read_and_the_process_goes_on() {
        let obj = Object::new(4096);
        let regions = Arc::new(Regions::new(true, 1 << 20, budget()));
        regions.register(None, None, "r", &obj.0, 0, 4096).unwrap();
        obj.file().set_len(0).unwrap();
        let e = access(&regions, None).read("x", &place("r", 0, 4096), DataType::Uint8, 4096).unwrap_err();
        assert!(e.to_string().contains("cannot read"), "{e}");
    }

    #[test]
    fn a_tenant_sees_uses_and_unregisters_its_own_regions_only() {
        let obj = Object::new(16);
        let regions = Arc::new(Regions::new(true, 1 << 20, budget()));
        regions.register(Some("a"), Some("a"), "r", &obj.0, 0, 16).unwrap();
        // Another tenant may not register the object a's region holds, by its key or another
        // naming it; the same name is another region for another tenant.
        for key in [obj.0.as_str(), obj.0.trim_start_matches('/')] {
            let e = regions.register(Some("b"), Some("b"), "r", key, 0, 8).unwrap_err().to_string();
            assert!(e.contains("registered by another tenant"), "{e}");
        }
        assert!(regions.register(None, None, "r", &obj.0, 0, 8).is_err());
        let theirs = Object::new(16);
        regions.register(Some("b"), Some("b"), "r", &theirs.0, 0, 8).unwrap();
        regions.register(Some("a"), Some("a"), "second", &obj.0, 0, 8).unwrap();
        assert!(access(&regions, Some("c")).read("x", &place("r", 0, 4), DataType::Uint8, 4).is_err());
        assert_eq!(regions.status(Some("b"), "").unwrap()[0].byte_size, 8);
        assert!(regions.status(None, "r").is_err());
        regions.unregister(Some("b"), "");
        assert!(regions.status(Some("b"), "r").is_err());
        assert_eq!(regions.status(Some("a"), "r").unwrap()[0].byte_size, 16);
        regions.unregister(Some("a"), "other");
        assert_eq!(regions.status(Some("a"), "").unwrap().len(), 2);
        regions.unregister(Some("a"), "");
        assert!(regions.status(Some("a"), "").unwrap().is_empty());
        // Once a's regions are gone, its object is anyone's to register.
        regions.register(Some("b"), Some("b"), "other", &obj.0, 0, 8).unwrap();
    }

    #[test]
    fn regions_are_bounded_and_their_places_come_back_when_unregistered() {
        // An object of each tenant's own (one tenant's is not another's to register).
        let objects: std::collections::HashMap<Option<&str>, Object> =
            [None, Some("a"), Some("b"), Some("c"), Some("d"), Some("e"), Some("guest-1"), Some("guest-2")]
                .into_iter()
                .map(|t| (t, Object::new(16)))
                .collect();
        let key = |t: Option<&str>| objects[&t].0.clone();
        let mut regions = Regions::new(true, 1 << 20, budget());
        regions.max_regions = 8;
        // A tenant holds a quarter at most: the others still register.
        regions.register(Some("a"), Some("a"), "1", &key(Some("a")), 0, 16).unwrap();
        regions.register(Some("a"), Some("a"), "2", &key(Some("a")), 0, 16).unwrap();
        assert!(matches!(
            regions.register(Some("a"), Some("a"), "3", &key(Some("a")), 0, 16),
            Err(Error::Overloaded { .. })
        ));
        for (t, n) in [("b", "1"), ("b", "2"), ("c", "1"), ("c", "2"), ("d", "1"), ("d", "2")] {
            regions.register(Some(t), Some(t), n, &key(Some(t)), 0, 16).unwrap();
        }
        // The server's bound: full.
        assert!(matches!(
            regions.register(Some("e"), Some("e"), "1", &key(Some("e")), 0, 16),
            Err(Error::Overloaded { .. })
        ));
        regions.unregister(Some("a"), "");
        regions.register(Some("e"), Some("e"), "1", &key(Some("e")), 0, 16).unwrap();
        // Without tenants, one client may take them all.
        let mut one = Regions::new(true, 1 << 20, budget());
        one.max_regions = 8;
        for n in 0..8 {
            one.register(None, None, &n.to_string(), &key(None), 0, 16).unwrap();
        }
        assert!(matches!(one.register(None, None, "8", &key(None), 0, 16), Err(Error::Overloaded { .. })));
        // Where tenants are configured, names made up and none count in one share (`auth::share`):
        // each made-up name held a quarter of its own, so four of them held every region.
        let mut shared = Regions::new(true, 1 << 20, budget());
        shared.max_regions = 8;
        let others = Some(crate::auth::OTHERS);
        shared.register(Some("guest-1"), others, "1", &key(Some("guest-1")), 0, 16).unwrap();
        shared.register(None, others, "1", &key(None), 0, 16).unwrap();
        let refused =
            shared.register(Some("guest-2"), others, "1", &key(Some("guest-2")), 0, 16).unwrap_err().to_string();
        assert!(refused.contains("no tenant of their own hold 2 shared memory regions"), "{refused}");
        shared.register(Some("a"), Some("a"), "1", &key(Some("a")), 0, 16).unwrap();
    }

    #[test]
    fn reads_are_bounded_per_request_and_hold_the_bodies_budget_while_their_tensors_live() {
        let obj = Object::new(8192);
        let budget = Budget::new(4 << 10);
        let regions = Arc::new(Regions::new(true, 6000, budget.clone()));
        regions.register(None, None, "r", &obj.0, 0, 8192).unwrap();
        let a = access(&regions, None);
        let first = a.read("x", &place("r", 0, 3000), DataType::Uint8, 3000).unwrap();
        assert_eq!(budget.available(), 1, "3 KiB held while the tensor lives");
        // Another request finds the budget spent: refused to come back, nothing read.
        let e = access(&regions, None).read("y", &place("r", 0, 2048), DataType::Uint8, 2048).unwrap_err();
        assert!(matches!(e, Error::Unavailable { retry_after: Some(_), .. }), "{e:?}");
        drop(first);
        assert_eq!(budget.available(), 4);
        // One request's reads together: within the body limit.
        let e = a.read("z", &place("r", 0, 3001), DataType::Uint8, 3001).unwrap_err().to_string();
        assert!(e.contains("over 6000 bytes"), "{e}");
    }

    #[test]
    fn nothing_registers_while_off_and_places_are_read_from_parameters() {
        let obj = Object::new(16);
        assert!(matches!(
            Regions::new(false, 1 << 20, budget()).register(None, None, "r", &obj.0, 0, 16),
            Err(Error::Unsupported(_))
        ));
        let params =
            |p: Vec<(&'static str, Param<'static>)>| move |k: &str| p.iter().find(|(n, _)| *n == k).map(|(_, v)| *v);
        assert_eq!(Place::of("x", params(vec![])).unwrap(), None);
        let p = params(vec![("shared_memory_region", Param::Str("r")), ("shared_memory_byte_size", Param::Int(8))]);
        assert_eq!(Place::of("x", p).unwrap(), Some(place("r", 0, 8)));
        assert!(Place::of("x", params(vec![("shared_memory_region", Param::Str("r"))])).is_err());
        assert!(Place::of("x", params(vec![("shared_memory_byte_size", Param::Uint(8))])).is_err());
        let negative = params(vec![
            ("shared_memory_region", Param::Str("r")),
            ("shared_memory_byte_size", Param::Int(8)),
            ("shared_memory_offset", Param::Int(-1)),
        ]);
        assert!(Place::of("x", negative).is_err());
    }
}
