//! Image steps: `decode_image` (JPEG, PNG, WebP; limits checked before decoding; EXIF
//! orientation; grayscale and alpha to RGB), `resize`, `pad`, `crop` and `normalize`. Each image
//! carries its geometry, so post-steps can map boxes back to the pixels of the image as sent.

use std::{collections::BTreeMap, io::Cursor};

use image::{DynamicImage, ImageDecoder, RgbImage};
use serde::Deserialize;

use super::{per_row, Kind, StepError, Value};
use crate::{DataType, Error, Result, Tensor, TensorData};

/// A decoded image and how its pixels map to the image as it was sent.
#[derive(Clone)]
pub(crate) struct Picture {
    pub pixels: RgbImage,
    pub geometry: Geometry,
}

/// `x_now = x_sent * scale_x + offset_x` (likewise y), and the size of the image as sent
/// (after its EXIF orientation).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Geometry {
    pub sent: (u32, u32),
    pub scale: (f64, f64),
    pub offset: (f64, f64),
}

impl Geometry {
    /// A point of the image now, in the pixels of the image as sent (clipped to it).
    pub fn back(&self, x: f32, y: f32) -> (f32, f32) {
        let bx = (x as f64 - self.offset.0) / self.scale.0;
        let by = (y as f64 - self.offset.1) / self.scale.1;
        (bx.clamp(0.0, self.sent.0 as f64) as f32, by.clamp(0.0, self.sent.1 as f64) as f32)
    }
}

fn default_image() -> String {
    "image".into()
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DecodeConfig {
    pub name: Option<String>,
    /// The BYTES input holding one encoded image per row (default `image`).
    #[serde(default = "default_image")]
    pub input: String,
    /// Where the decoded images go (default: the input's name).
    pub output: Option<String>,
    /// Largest encoded image accepted (default 20 MiB).
    pub max_bytes: Option<usize>,
    /// Largest width x height accepted, read from the header before decoding (default 40 million).
    pub max_pixels: Option<u64>,
    /// Largest width or height accepted, read from the header (default 16384).
    pub max_side: Option<u32>,
    /// Decoded pixels of all the images of one request together (default 64 million).
    pub max_request_pixels: Option<u64>,
    /// Most scans a progressive JPEG may have (default 32; each scan is a pass over the image).
    pub max_scans: Option<usize>,
    /// What becomes of an alpha channel (default `over_white`).
    #[serde(default, deserialize_with = "super::any_case")]
    pub alpha: Alpha,
}

/// An image's alpha channel, on the way to RGB.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum Alpha {
    /// Composited over white, as a browser shows a transparent PNG.
    #[default]
    OverWhite,
    /// Composited over black (premultiplied).
    OverBlack,
    /// Dropped, the colours kept as they are: Pillow's `convert("RGB")` and OpenCV's `imread`.
    Drop,
}

impl DecodeConfig {
    pub(crate) fn input(&self) -> &str {
        &self.input
    }

    pub(crate) fn output(&self) -> &str {
        self.output.as_deref().unwrap_or(&self.input)
    }
}

pub(crate) struct Decode {
    input: String,
    output: String,
    max_bytes: usize,
    max_pixels: u64,
    max_side: u32,
    /// Per request: decoded pixels of all its images together.
    pub max_request_pixels: u64,
    max_scans: usize,
    alpha: Alpha,
}

/// The largest side and area any image step may make, or hold as an intermediate buffer (a
/// resize's first pass is as wide as its source and as high as its output).
pub(crate) const MAX_SIDE: u32 = 16384;
pub(crate) const MAX_STEP_PIXELS: u64 = 64_000_000;

impl Decode {
    pub fn new(c: &DecodeConfig) -> Result<Decode> {
        let d = Decode {
            input: c.input.clone(),
            output: c.output().to_string(),
            max_bytes: c.max_bytes.unwrap_or(20 << 20),
            max_pixels: c.max_pixels.unwrap_or(40_000_000),
            max_side: c.max_side.unwrap_or(MAX_SIDE),
            max_request_pixels: c.max_request_pixels.unwrap_or(64_000_000),
            max_scans: c.max_scans.unwrap_or(32),
            alpha: c.alpha,
        };
        if d.max_pixels > MAX_STEP_PIXELS || d.max_side > MAX_SIDE || d.max_bytes > 1 << 30 {
            return Err(Error::invalid(format!(
                "max_pixels is at most {MAX_STEP_PIXELS}, max_side {MAX_SIDE}, max_bytes 1 GiB"
            )));
        }
        Ok(d)
    }

    pub fn input(&self) -> &str {
        &self.input
    }

    /// The image of one row (one BYTES element).
    pub fn image(t: &Tensor) -> Result<&[u8]> {
        let TensorData::Strings(items) = &t.data else { return Err(Error::invalid("the image is not BYTES")) };
        let [bytes] = items.as_slice() else {
            return Err(Error::invalid(format!("one image per row expected, got {} elements", items.len())));
        };
        Ok(bytes)
    }

    pub fn run(&self, values: &mut BTreeMap<String, Value>) -> Result<(), StepError> {
        let rows = super::rows_of(values, &self.input)?;
        let pictures = per_row(rows, |t| self.decode(Self::image(t)?))?;
        values.insert(self.output.clone(), Value::Images(pictures));
        Ok(())
    }

    /// Width and height as the header declares them (after the checks that need no decoding):
    /// what decoding the image will cost, to charge it before paying.
    pub fn declared(&self, bytes: &[u8]) -> Result<(u32, u32)> {
        let (_, (w, h)) = self.open(bytes, false)?;
        Ok((w, h))
    }

    /// The decoder, after every check that can be made before decoding: size in bytes, format,
    /// each side and the area, the bytes the decoded pixels take, and (JPEG) the scans and that
    /// the file is whole (`whole`: a walk over all its bytes, left for the decode itself).
    fn open<'b>(&self, bytes: &'b [u8], whole: bool) -> Result<(Box<dyn ImageDecoder + 'b>, (u32, u32))> {
        if bytes.is_empty() {
            return Err(Error::invalid("the image is empty"));
        }
        if bytes.len() > self.max_bytes {
            return Err(Error::invalid(format!(
                "the image has {} bytes, more than {} (decode_image max_bytes)",
                bytes.len(),
                self.max_bytes
            )));
        }
        let bad = |e: image::ImageError| Error::invalid(format!("cannot decode the image: {e}"));
        let mut reader =
            image::ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|e| bad(e.into()))?;
        match reader.format() {
            Some(image::ImageFormat::Jpeg) if whole => jpeg_scans(bytes, self.max_scans)?,
            Some(image::ImageFormat::Jpeg) => {}
            Some(image::ImageFormat::Png | image::ImageFormat::WebP) => {}
            _ => return Err(Error::invalid("the image is not a JPEG, PNG or WebP")),
        }
        let mut limits = image::Limits::default();
        limits.max_alloc = Some(self.max_pixels.saturating_mul(8).max(1 << 20));
        limits.max_image_width = Some(self.max_side);
        limits.max_image_height = Some(self.max_side);
        reader.limits(limits);
        let decoder = reader.into_decoder().map_err(|e| match e {
            image::ImageError::Limits(_) => Error::invalid(format!(
                "the image is larger than {} pixels on a side (decode_image max_side)",
                self.max_side
            )),
            e => bad(e),
        })?;
        let (w, h) = decoder.dimensions();
        if w == 0 || h == 0 {
            return Err(Error::invalid("the image has no pixels"));
        }
        if w > self.max_side || h > self.max_side {
            return Err(Error::invalid(format!(
                "the image is {w}x{h}, more than {} pixels on a side (decode_image max_side)",
                self.max_side
            )));
        }
        if u64::from(w) * u64::from(h) > self.max_pixels {
            return Err(Error::invalid(format!(
                "the image is {w}x{h}, more than {} pixels (decode_image max_pixels)",
                self.max_pixels
            )));
        }
        // 16-bit and float images take several times the bytes of 8-bit RGBA: bounded alike.
        if decoder.total_bytes() > self.max_pixels.saturating_mul(4) {
            return Err(Error::invalid(format!(
                "the image is {w}x{h} of {:?}, {} bytes decoded, more than {} (4 x decode_image max_pixels)",
                decoder.color_type(),
                decoder.total_bytes(),
                self.max_pixels.saturating_mul(4)
            )));
        }
        Ok((Box::new(decoder), (w, h)))
    }

    fn decode(&self, bytes: &[u8]) -> Result<Picture> {
        let bad = |e: image::ImageError| Error::invalid(format!("cannot decode the image: {e}"));
        let (mut decoder, _) = self.open(bytes, true)?;
        let orientation = decoder.orientation().unwrap_or(image::metadata::Orientation::NoTransforms);
        let jpeg = image::guess_format(bytes).ok() == Some(image::ImageFormat::Jpeg);
        let rgb = match if jpeg { libjpeg_rgb(bytes)? } else { None } {
            Some(rgb) => rgb,
            None => flatten(DynamicImage::from_decoder(decoder).map_err(bad)?, self.alpha),
        };
        // To 8-bit RGB first, so the rotation copies the smallest form of the image.
        let mut pixels = DynamicImage::ImageRgb8(rgb);
        pixels.apply_orientation(orientation);
        let pixels = pixels.into_rgb8();
        let sent = pixels.dimensions();
        Ok(Picture { pixels, geometry: Geometry { sent, scale: (1.0, 1.0), offset: (0.0, 0.0) } })
    }
}

/// A YCbCr, RGB or grayscale JPEG decoded as libjpeg-turbo decodes it by default (accurate
/// integer IDCT, fancy chroma upsampling, its fixed-point colour conversion), which Pillow,
/// OpenCV and torchvision use: the same bytes (the Rust decoders differ by up to 3 levels on a
/// quarter of the pixels). `None` for other colour spaces (CMYK, YCCK), left to the image crate.
/// Called after `open`'s checks (sides, area, scans, a whole file); libjpeg's fatal errors
/// unwind out of it as a panic payload, turned here into the request's error.
fn libjpeg_rgb(bytes: &[u8]) -> Result<Option<RgbImage>> {
    use mozjpeg::ColorSpace as Cs;
    let decode = || -> std::io::Result<Option<RgbImage>> {
        let d = mozjpeg::Decompress::new_mem(bytes)?;
        if !matches!(d.color_space(), Cs::JCS_YCbCr | Cs::JCS_RGB | Cs::JCS_GRAYSCALE) {
            return Ok(None);
        }
        let mut started = d.rgb()?;
        let (w, h) = (started.width() as u32, started.height() as u32);
        let pixels = started.read_scanlines::<u8>()?;
        started.finish()?;
        Ok(RgbImage::from_raw(w, h, pixels))
    };
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(decode)) {
        Ok(Ok(rgb)) => Ok(rgb),
        Ok(Err(e)) => Err(Error::invalid(format!("cannot decode the image: {e}"))),
        Err(payload) => {
            let why = payload.downcast_ref::<String>().map_or("libjpeg failed", String::as_str);
            Err(Error::invalid(format!("cannot decode the image: {why}")))
        }
    }
}

/// Walks a JPEG's segments (no decoding): refuses one with more than `max_scans` scans (each a
/// pass over the whole image: a 100-scan progressive file costs seconds to decode) and one cut
/// short before its end marker, which decoders would fill with gray (Pillow and OpenCV refuse it).
fn jpeg_scans(b: &[u8], max_scans: usize) -> Result<()> {
    let cut = || Error::invalid("cannot decode the image: the JPEG is truncated (no end of image marker)");
    let mut i = 2; // after SOI
    let mut scans = 0;
    loop {
        // Fill bytes may precede a marker.
        while b.get(i) == Some(&0xFF) && b.get(i + 1) == Some(&0xFF) {
            i += 1;
        }
        let (Some(&0xFF), Some(&marker)) = (b.get(i), b.get(i + 1)) else { return Err(cut()) };
        i += 2;
        match marker {
            0xD9 => return Ok(()),
            0x01 | 0xD0..=0xD7 => continue,
            _ => {}
        }
        let len = match (b.get(i), b.get(i + 1)) {
            (Some(&h), Some(&l)) => usize::from(h) << 8 | usize::from(l),
            _ => return Err(cut()),
        };
        if len < 2 {
            return Err(Error::invalid("cannot decode the image: a JPEG segment has a bad length"));
        }
        i += len;
        if marker == 0xDA {
            scans += 1;
            if scans > max_scans {
                return Err(Error::invalid(format!(
                    "the JPEG has more than {max_scans} scans (decode_image max_scans)"
                )));
            }
            // Entropy-coded data runs to the next marker that is not a stuffed 0xFF00 or a restart.
            loop {
                match b.get(i..).and_then(|rest| rest.iter().position(|&x| x == 0xFF)) {
                    None => return Err(cut()),
                    Some(at) => i += at,
                }
                match b.get(i + 1) {
                    Some(0x00 | 0xD0..=0xD7 | 0xFF) => i += 1,
                    Some(_) => break,
                    None => return Err(cut()),
                }
            }
        }
    }
}

/// RGB of any decoded image: gray spread to three channels, alpha as `alpha` says.
fn flatten(img: DynamicImage, alpha: Alpha) -> RgbImage {
    let background = match alpha {
        _ if !img.color().has_alpha() => return img.into_rgb8(),
        Alpha::Drop => return img.into_rgb8(),
        Alpha::OverWhite => 255,
        Alpha::OverBlack => 0,
    };
    let rgba = img.into_rgba8();
    let (w, h) = rgba.dimensions();
    let mut out = RgbImage::new(w, h);
    for (o, p) in out.pixels_mut().zip(rgba.pixels()) {
        let a = p[3] as u32;
        for c in 0..3 {
            o[c] = ((p[c] as u32 * a + background * (255 - a) + 127) / 255) as u8;
        }
    }
    out
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum Filter {
    Nearest,
    #[default]
    Bilinear,
    Bicubic,
    /// The average of the pixels each output pixel covers: Pillow's `BOX`, or with
    /// `antialias = false` OpenCV's `INTER_AREA`.
    Area,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum ResizeMode {
    /// To `size = [width, height]` exactly.
    #[default]
    Exact,
    /// The shorter side to `size = n`, keeping the ratio (classifiers' 256 before a 224 crop):
    /// the longer side `floor(n * longer / shorter)`, as torchvision's `Resize(n)` computes it.
    ShorterSide,
    /// The longer side to `size = n`, keeping the ratio (a detector's letterbox, before `pad`):
    /// the other side `round(side * n / longer)`, half to even, as ultralytics' `LetterBox`.
    LongerSide,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ResizeConfig {
    pub name: Option<String>,
    pub input: Option<String>,
    pub output: Option<String>,
    #[serde(default, deserialize_with = "super::any_case")]
    pub mode: ResizeMode,
    /// `[width, height]` for `exact`, one number for the others.
    pub size: Vec<u32>,
    #[serde(default, deserialize_with = "super::any_case")]
    pub filter: Filter,
    /// `true` (default): Pillow's `Image.resize` (the filter widened when shrinking, as
    /// torchvision's `antialias=True`); `false`: OpenCV's `cv2.resize` with `INTER_LINEAR`,
    /// `INTER_AREA` or `INTER_NEAREST`, to the byte.
    #[serde(default = "yes")]
    pub antialias: bool,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum PadMode {
    /// To a square of the longer side.
    #[default]
    Square,
    /// Each side up to the next multiple of `multiple`.
    Multiple,
    /// To `size = [width, height]` (at least the image's size).
    Size,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum Anchor {
    /// The image in the middle (ultralytics' letterbox).
    #[default]
    Center,
    /// The image at the top-left, padding right and below.
    TopLeft,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PadConfig {
    pub name: Option<String>,
    pub input: Option<String>,
    pub output: Option<String>,
    #[serde(default, deserialize_with = "super::any_case")]
    pub mode: PadMode,
    pub multiple: Option<u32>,
    pub size: Option<Vec<u32>>,
    #[serde(default, deserialize_with = "super::any_case")]
    pub anchor: Anchor,
    /// The padding's value in every channel (ultralytics uses 114).
    #[serde(default)]
    pub value: u8,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CropConfig {
    pub name: Option<String>,
    pub input: Option<String>,
    pub output: Option<String>,
    /// `[width, height]` of the centre crop.
    pub size: Vec<u32>,
}

fn pair(size: &[u32], what: &str) -> Result<(u32, u32)> {
    match size {
        [w, h]
            if (1..=MAX_SIDE).contains(w)
                && (1..=MAX_SIDE).contains(h)
                && u64::from(*w) * u64::from(*h) <= MAX_STEP_PIXELS =>
        {
            Ok((*w, *h))
        }
        _ => Err(Error::invalid(format!(
            "{what} must be [width, height], each 1..={MAX_SIDE}, at most {MAX_STEP_PIXELS} pixels"
        ))),
    }
}

pub(crate) enum ImageOp {
    Resize { input: String, output: String, mode: ResizeMode, size: Vec<u32>, filter: Filter, antialias: bool },
    Pad { input: String, output: String, mode: PadMode, multiple: u32, size: (u32, u32), anchor: Anchor, value: u8 },
    Crop { input: String, output: String, size: (u32, u32) },
}

impl ImageOp {
    /// The op and the size of the images it makes (when known for every row).
    pub fn resize(c: &ResizeConfig, _: Option<(u32, u32)>) -> Result<(ImageOp, Option<(u32, u32)>)> {
        let out = match c.mode {
            ResizeMode::Exact => Some(pair(&c.size, "size")?),
            _ => {
                match c.size.as_slice() {
                    [n] if (1..=MAX_SIDE).contains(n) => {}
                    _ => return Err(Error::invalid(format!("size must be one number 1..={MAX_SIDE} for this mode"))),
                }
                None
            }
        };
        if !c.antialias && c.filter == Filter::Bicubic {
            return Err(Error::invalid(
                "filter = \"bicubic\" with antialias = false (OpenCV's INTER_CUBIC) is not available: use \
                 filter = \"bilinear\", \"area\" or \"nearest\" (cv2.INTER_LINEAR, INTER_AREA, INTER_NEAREST), or \
                 antialias = true",
            ));
        }
        let output = c.output.clone().unwrap_or_default();
        let (mode, size, filter, antialias) = (c.mode, c.size.clone(), c.filter, c.antialias);
        Ok((ImageOp::Resize { input: String::new(), output, mode, size, filter, antialias }, out))
    }

    pub fn pad(c: &PadConfig, before: Option<(u32, u32)>) -> Result<(ImageOp, Option<(u32, u32)>)> {
        let multiple = c.multiple.unwrap_or(32);
        let size = match c.mode {
            PadMode::Size => pair(c.size.as_deref().unwrap_or_default(), "size")?,
            _ => (0, 0),
        };
        if c.mode == PadMode::Multiple && !(1..=1024).contains(&multiple) {
            return Err(Error::invalid("multiple must be 1..=1024"));
        }
        let out = match c.mode {
            PadMode::Size => Some(size),
            _ => before.map(|(w, h)| padded(c.mode, multiple, size, w, h)),
        };
        let output = c.output.clone().unwrap_or_default();
        let op = ImageOp::Pad {
            input: String::new(),
            output,
            mode: c.mode,
            multiple,
            size,
            anchor: c.anchor,
            value: c.value,
        };
        Ok((op, out))
    }

    pub fn crop(c: &CropConfig, _: Option<(u32, u32)>) -> Result<(ImageOp, Option<(u32, u32)>)> {
        let size = pair(&c.size, "size")?;
        let output = c.output.clone().unwrap_or_default();
        Ok((ImageOp::Crop { input: String::new(), output, size }, Some(size)))
    }

    /// Sets the input (and the output, where the config named none) once the build knows it.
    pub fn with_input(mut self, name: &str) -> ImageOp {
        let (ImageOp::Resize { input, output, .. }
        | ImageOp::Pad { input, output, .. }
        | ImageOp::Crop { input, output, .. }) = &mut self;
        *input = name.to_string();
        if output.is_empty() {
            *output = name.to_string();
        }
        self
    }

    pub fn run(&self, values: &mut BTreeMap<String, Value>) -> Result<(), StepError> {
        let (ImageOp::Resize { input, output, .. }
        | ImageOp::Pad { input, output, .. }
        | ImageOp::Crop { input, output, .. }) = self;
        let Some(Value::Images(pictures)) = values.get(input) else {
            return Err(StepError::Batch(Error::internal(format!("'{input}' is not an image"))));
        };
        let out = per_row(pictures, |p| self.apply(p))?;
        values.insert(output.clone(), Value::Images(out));
        Ok(())
    }

    fn apply(&self, p: &Picture) -> Result<Picture> {
        let (w, h) = p.pixels.dimensions();
        match self {
            ImageOp::Resize { mode, size, filter, antialias, .. } => {
                let (nw, nh) = match mode {
                    ResizeMode::Exact => (size[0], size[1]),
                    ResizeMode::ShorterSide | ResizeMode::LongerSide => {
                        let n = f64::from(size[0]);
                        let (short, long) = (f64::from(w.min(h)), f64::from(w.max(h)));
                        // The side asked for is `n` exactly; the other follows each library's rule.
                        let other = if *mode == ResizeMode::ShorterSide {
                            (n * long / short).floor()
                        } else {
                            (short * (n / long)).round_ties_even()
                        }
                        .max(1.0);
                        let wide = (w >= h) == (*mode == ResizeMode::LongerSide);
                        let (fw, fh) = if wide { (n, other) } else { (other, n) };
                        if fw > MAX_SIDE as f64 || fh > MAX_SIDE as f64 {
                            return Err(Error::invalid(format!(
                                "the image is {w}x{h}; resizing it to {} side {} would make it {fw}x{fh}, more than {MAX_SIDE} on a side",
                                if *mode == ResizeMode::ShorterSide { "shorter" } else { "longer" },
                                size[0]
                            )));
                        }
                        (fw as u32, fh as u32)
                    }
                };
                // The output, and the first pass's buffer (source width x output height, or
                // output width x source height), are bounded before anything is allocated.
                let most = [(nw, nh), (w, nh), (nw, h)].into_iter().map(|(a, b)| u64::from(a) * u64::from(b)).max();
                if most.unwrap_or(0) > MAX_STEP_PIXELS {
                    return Err(Error::invalid(format!(
                        "resizing the image from {w}x{h} to {nw}x{nh} needs more than {MAX_STEP_PIXELS} pixels"
                    )));
                }
                let pixels = match (antialias, filter) {
                    (false, Filter::Bilinear) => opencv_linear(&p.pixels, nw, nh, taps(nw, w), taps(nh, h)),
                    (false, Filter::Area) => opencv_area(&p.pixels, nw, nh),
                    (false, Filter::Nearest) => opencv_nearest(&p.pixels, nw, nh),
                    _ => resize(&p.pixels, nw, nh, *filter)?,
                };
                let (sx, sy) = (nw as f64 / w as f64, nh as f64 / h as f64);
                let g = p.geometry;
                let geometry = Geometry {
                    sent: g.sent,
                    scale: (g.scale.0 * sx, g.scale.1 * sy),
                    offset: (g.offset.0 * sx, g.offset.1 * sy),
                };
                Ok(Picture { pixels, geometry })
            }
            ImageOp::Pad { mode, multiple, size, anchor, value, .. } => {
                let (nw, nh) = padded(*mode, *multiple, *size, w, h);
                if nw < w || nh < h {
                    return Err(Error::invalid(format!("the image is {w}x{h}, larger than the pad size {nw}x{nh}")));
                }
                if nw > MAX_SIDE || nh > MAX_SIDE || u64::from(nw) * u64::from(nh) > MAX_STEP_PIXELS {
                    return Err(Error::invalid(format!(
                        "padding the image {w}x{h} would make it {nw}x{nh}, more than {MAX_SIDE} on a side or {MAX_STEP_PIXELS} pixels"
                    )));
                }
                let (left, top) = match anchor {
                    Anchor::Center => ((nw - w) / 2, (nh - h) / 2),
                    Anchor::TopLeft => (0, 0),
                };
                let mut pixels = RgbImage::from_pixel(nw, nh, image::Rgb([*value; 3]));
                image::imageops::replace(&mut pixels, &p.pixels, left as i64, top as i64);
                let g = p.geometry;
                let geometry = Geometry { offset: (g.offset.0 + left as f64, g.offset.1 + top as f64), ..g };
                Ok(Picture { pixels, geometry })
            }
            ImageOp::Crop { size: (cw, ch), .. } => {
                if *cw > w || *ch > h {
                    return Err(Error::invalid(format!("the image is {w}x{h}, smaller than the crop {cw}x{ch}")));
                }
                let (left, top) = ((w - cw) / 2, (h - ch) / 2);
                let pixels = image::imageops::crop_imm(&p.pixels, left, top, *cw, *ch).to_image();
                let g = p.geometry;
                let geometry = Geometry { offset: (g.offset.0 - left as f64, g.offset.1 - top as f64), ..g };
                Ok(Picture { pixels, geometry })
            }
        }
    }
}

fn padded(mode: PadMode, multiple: u32, size: (u32, u32), w: u32, h: u32) -> (u32, u32) {
    match mode {
        PadMode::Square => (w.max(h), w.max(h)),
        PadMode::Multiple => (w.div_ceil(multiple) * multiple, h.div_ceil(multiple) * multiple),
        PadMode::Size => size,
    }
}

/// Resizes as Pillow's `Image.resize` does, to the byte: a convolution whose support widens when
/// shrinking, weights in Pillow's 22-bit fixed point, across then down, each pass rounded to 8
/// bits (libImaging/Resample.c); `nearest` as its affine transform picks pixels.
fn resize(src: &RgbImage, w: u32, h: u32, filter: Filter) -> Result<RgbImage> {
    let (sw, sh) = src.dimensions();
    if (sw, sh) == (w, h) {
        return Ok(src.clone());
    }
    if filter == Filter::Nearest {
        // Pillow's ImagingScaleAffine: the source position starts at half a step and grows by
        // one step per pixel (a sum, whose rounding decides some pixels).
        let picks = |dst: u32, src: u32| {
            let step = f64::from(src) / f64::from(dst);
            let mut at = step * 0.5;
            (0..dst)
                .map(|_| {
                    let i = (at as u32).min(src - 1);
                    at += step;
                    i
                })
                .collect::<Vec<u32>>()
        };
        return Ok(pick(src, &picks(w, sw), &picks(h, sh)));
    }
    let (xs, ys) = (PillowTaps::new(sw, w, filter), PillowTaps::new(sh, h, filter));
    let out = convolve(src, w, h, &xs, &ys);
    RgbImage::from_raw(w, h, out).ok_or_else(|| Error::internal("resize: buffer size"))
}

/// Both passes of Pillow's resize. Where the CPU has AVX2 (checked at run time) the passes are
/// compiled for it and each tap across is one four-lane multiply-add: the same integers, 4-5x
/// faster than the scalar sums.
fn convolve(src: &RgbImage, w: u32, h: u32, xs: &PillowTaps, ys: &PillowTaps) -> Vec<u8> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { convolve_avx2(src, w, h, xs, ys) };
    }
    passes(src, w, h, xs, ys, across_scalar)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn convolve_avx2(src: &RgbImage, w: u32, h: u32, xs: &PillowTaps, ys: &PillowTaps) -> Vec<u8> {
    passes(src, w, h, xs, ys, |line, xs, out| {
        // SAFETY: this runs only where AVX2 was detected (see `convolve`).
        unsafe { across_avx2(line, xs, out) }
    })
}

/// One row across: `line` is the source row with one byte to spare past its last pixel.
fn across_scalar(line: &[u8], xs: &PillowTaps, out: &mut Vec<u8>) {
    for (d, &(lo, n)) in xs.bounds.iter().enumerate() {
        let mut sum = [HALF; 3];
        for (p, &kw) in line[lo * 3..(lo + n) * 3].chunks_exact(3).zip(&xs.weights[d * xs.size..d * xs.size + n]) {
            for c in 0..3 {
                sum[c] += i32::from(p[c]) * kw;
            }
        }
        out.extend(sum.map(clip8));
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn across_avx2(line: &[u8], xs: &PillowTaps, out: &mut Vec<u8>) {
    use std::arch::x86_64::*;
    for (d, &(lo, n)) in xs.bounds.iter().enumerate() {
        let k = &xs.weights[d * xs.size..d * xs.size + n];
        // Bytes read: from pixel `lo`, three per tap and one more (`line` has it to spare).
        let pixels = &line[lo * 3..lo * 3 + n * 3 + 1];
        let mut acc = _mm_set1_epi32(HALF);
        for (j, &kw) in k.iter().enumerate() {
            // SAFETY: `pixels` holds bytes j*3 .. j*3+4 for every j < n (sliced above).
            let four = unsafe { pixels.as_ptr().add(j * 3).cast::<i32>().read_unaligned() };
            let px = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(four));
            acc = _mm_add_epi32(acc, _mm_mullo_epi32(px, _mm_set1_epi32(kw)));
        }
        let mut v = [0i32; 4];
        // SAFETY: `v` is 16 writable bytes.
        unsafe { _mm_storeu_si128(v.as_mut_ptr().cast(), acc) };
        out.extend([clip8(v[0]), clip8(v[1]), clip8(v[2])]);
    }
}

#[inline(always)]
fn passes(
    src: &RgbImage,
    w: u32,
    h: u32,
    xs: &PillowTaps,
    ys: &PillowTaps,
    across_row: impl Fn(&[u8], &PillowTaps, &mut Vec<u8>),
) -> Vec<u8> {
    let (sw, sh) = src.dimensions();
    // Only the source rows some output row reads are resized across (Pillow's ybox).
    let first = ys.bounds.first().map_or(0, |b| b.0);
    let last = ys.bounds.last().map_or(0, |b| b.0 + b.1);
    let raw = src.as_raw();
    let (stride, width) = (sw as usize * 3, w as usize * 3);
    let across: Vec<u8> = if sw == w {
        raw[first * stride..last * stride].to_vec()
    } else {
        let mut out = Vec::with_capacity((last - first) * width);
        let mut line = vec![0u8; stride + 1];
        for y in first..last {
            line[..stride].copy_from_slice(&raw[y * stride..(y + 1) * stride]);
            across_row(&line, xs, &mut out);
        }
        out
    };
    if sh == h {
        return across;
    }
    let mut out = Vec::with_capacity(width * h as usize);
    let mut sum = vec![0i32; width];
    for (d, &(lo, n)) in ys.bounds.iter().enumerate() {
        sum.fill(HALF);
        let rows = &across[(lo - first) * width..(lo - first + n) * width];
        for (row, &kw) in rows.chunks_exact(width).zip(&ys.weights[d * ys.size..d * ys.size + n]) {
            for (s, &p) in sum.iter_mut().zip(row) {
                *s += i32::from(p) * kw;
            }
        }
        out.extend(sum.iter().map(|&v| clip8(v)));
    }
    out
}

/// Pillow's fixed point: weights are scaled by 2^22 and sums start at one half.
const PRECISION_BITS: u32 = 22;
const HALF: i32 = 1 << (PRECISION_BITS - 1);

fn clip8(v: i32) -> u8 {
    (v >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Pillow's coefficients (`precompute_coeffs`, `normalize_coeffs_8bpc`) for `dst` outputs from
/// `src` inputs: each output's first source index and count, and `size` weights per output.
struct PillowTaps {
    bounds: Vec<(usize, usize)>,
    weights: Vec<i32>,
    size: usize,
}

impl PillowTaps {
    fn new(src: u32, dst: u32, filter: Filter) -> PillowTaps {
        let (support, kernel): (f64, fn(f64) -> f64) = match filter {
            Filter::Bicubic => (2.0, |x| {
                let (a, x) = (-0.5, x.abs());
                if x < 1.0 {
                    ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * a
                } else {
                    0.0
                }
            }),
            Filter::Area => (0.5, |x| if x > -0.5 && x <= 0.5 { 1.0 } else { 0.0 }),
            _ => (1.0, |x| {
                let x = x.abs();
                if x < 1.0 {
                    1.0 - x
                } else {
                    0.0
                }
            }),
        };
        let scale = f64::from(src) / f64::from(dst);
        let filterscale = scale.max(1.0);
        let support = support * filterscale;
        let size = support.ceil() as usize * 2 + 1;
        let (mut bounds, mut weights) = (Vec::with_capacity(dst as usize), Vec::with_capacity(dst as usize * size));
        let mut k = vec![0f64; size];
        let ss = 1.0 / filterscale;
        for d in 0..dst {
            let center = (f64::from(d) + 0.5) * scale;
            let lo = ((center - support + 0.5) as i64).max(0) as usize;
            let hi = ((center + support + 0.5) as i64).min(i64::from(src)) as usize;
            let n = hi.saturating_sub(lo).min(size);
            k.fill(0.0);
            let mut total = 0.0;
            for (i, w) in k[..n].iter_mut().enumerate() {
                *w = kernel(((lo + i) as f64 - center + 0.5) * ss);
                total += *w;
            }
            if total != 0.0 {
                k[..n].iter_mut().for_each(|w| *w /= total);
            }
            let unit = f64::from(1u32 << PRECISION_BITS);
            weights.extend(k.iter().map(|&w| if w < 0.0 { (-0.5 + w * unit) as i32 } else { (0.5 + w * unit) as i32 }));
            bounds.push((lo, n));
        }
        PillowTaps { bounds, weights, size }
    }
}

/// One output coordinate of OpenCV's two-tap resize: the two source indices (clamped to the
/// image) and their weights in 11-bit fixed point.
struct Tap {
    at: [usize; 2],
    weight: [i32; 2],
}

impl Tap {
    /// Source pixels `s` and `s + 1` (clamped to `0..=last`) weighted `1 - f` and `f`, each
    /// rounded half to even to 2048ths as OpenCV's `saturate_cast<short>` does.
    fn new(s: i64, f: f32, last: i64) -> Tap {
        Tap {
            at: [s.clamp(0, last) as usize, (s + 1).clamp(0, last) as usize],
            weight: [((1.0 - f) * 2048.0).round_ties_even() as i32, (f * 2048.0).round_ties_even() as i32],
        }
    }
}

/// OpenCV's coefficients for `dst` outputs from `src` inputs (`cv::resize`, `INTER_LINEAR`): the
/// source position `(d + 0.5) * src / dst - 0.5` in single precision, its fraction rounded
/// (half to even) to 2048ths; positions outside the image keep their weights on the edge pixel.
fn taps(dst: u32, src: u32) -> Vec<Tap> {
    let scale = 1.0 / (f64::from(dst) / f64::from(src));
    let last = i64::from(src) - 1;
    (0..dst)
        .map(|d| {
            let f = ((f64::from(d) + 0.5) * scale - 0.5) as f32;
            let s = f.floor();
            Tap::new(s as i64, f - s, last)
        })
        .collect()
}

/// `INTER_AREA`'s coefficients where it enlarges (OpenCV then interpolates between two pixels,
/// with the weight `(d + 1) - (s + 1) * dst / src` for source pixel `s = floor(d * src / dst)`).
fn area_taps(dst: u32, src: u32) -> Vec<Tap> {
    let inv = f64::from(dst) / f64::from(src);
    let scale = 1.0 / inv;
    let last = i64::from(src) - 1;
    (0..dst)
        .map(|d| {
            let s = (f64::from(d) * scale).floor() as i64;
            let f = ((f64::from(d) + 1.0) - (s as f64 + 1.0) * inv) as f32;
            Tap::new(s, if f <= 0.0 { 0.0 } else { f - f.floor() }, last)
        })
        .collect()
}

/// `cv2.resize(img, (w, h), interpolation=cv2.INTER_LINEAR)` on an 8-bit RGB image, to the byte
/// (with `taps`; `INTER_AREA` where it enlarges, with `area_taps`): each source row is resized
/// across in integers (pixel x 2048ths), then two such rows are combined as OpenCV's vector code
/// does, each product shifted before the sum and rounded in the last two bits
/// (tests/test_pipelines.py checks it against OpenCV on odd sizes, up and down). Two rows of the
/// first pass are kept at a time.
fn opencv_linear(src: &RgbImage, w: u32, h: u32, xs: Vec<Tap>, ys: Vec<Tap>) -> RgbImage {
    let sw = src.width();
    let raw = src.as_raw();
    let stride = sw as usize * 3;
    let across = |y: usize, row: &mut Vec<i32>| {
        let line = &raw[y * stride..(y + 1) * stride];
        row.clear();
        for t in &xs {
            for c in 0..3 {
                let (p0, p1) = (i32::from(line[t.at[0] * 3 + c]), i32::from(line[t.at[1] * 3 + c]));
                row.push(p0 * t.weight[0] + p1 * t.weight[1]);
            }
        }
    };
    let mut kept: [(usize, Vec<i32>); 2] = [(usize::MAX, Vec::new()), (usize::MAX, Vec::new())];
    let mut out = Vec::with_capacity(w as usize * h as usize * 3);
    for t in &ys {
        for (k, &y) in t.at.iter().enumerate() {
            if kept[k].0 != y {
                // Rows only move down: the row wanted may be the one the other slot holds.
                if let Some(other) = kept.iter().position(|r| r.0 == y) {
                    let row = kept[other].1.clone();
                    kept[k] = (y, row);
                } else {
                    across(y, &mut kept[k].1);
                    kept[k].0 = y;
                }
            }
        }
        let (b0, b1) = (t.weight[0], t.weight[1]);
        for (s0, s1) in kept[0].1.iter().zip(&kept[1].1) {
            let v = ((((s0 >> 4) * b0) >> 16) + (((s1 >> 4) * b1) >> 16) + 2) >> 2;
            out.push(v.clamp(0, 255) as u8);
        }
    }
    RgbImage::from_raw(w, h, out).expect("w x h x 3 bytes")
}

/// `cv2.resize(img, (w, h), interpolation=cv2.INTER_AREA)` on an 8-bit RGB image, to the byte.
/// Shrinking both ways, each output pixel is the average of the source area it covers: by whole
/// blocks when the sizes divide (2x2 rounded as OpenCV's vector code, `(sum + 2) >> 2`; other
/// blocks `sum * (1 / area)` in single precision, rounded half to even), else with fractional
/// weights at the edges of each area, summed in single precision in OpenCV's order. Enlarging
/// either way, it interpolates with `area_taps`.
fn opencv_area(src: &RgbImage, w: u32, h: u32) -> RgbImage {
    let (sw, sh) = src.dimensions();
    let (scale_x, scale_y) = (1.0 / (f64::from(w) / f64::from(sw)), 1.0 / (f64::from(h) / f64::from(sh)));
    if scale_x < 1.0 || scale_y < 1.0 {
        return opencv_linear(src, w, h, area_taps(w, sw), area_taps(h, sh));
    }
    let raw = src.as_raw();
    let stride = sw as usize * 3;
    let (ix, iy) = (scale_x.round(), scale_y.round());
    if (scale_x - ix).abs() < f64::EPSILON && (scale_y - iy).abs() < f64::EPSILON {
        let (kx, ky) = (ix as usize, iy as usize);
        let inv_area = 1.0 / (kx * ky) as f32;
        let mut out = Vec::with_capacity(w as usize * h as usize * 3);
        for dy in 0..h as usize {
            for dx in 0..w as usize {
                for c in 0..3 {
                    let mut sum = 0u32;
                    for y in dy * ky..(dy + 1) * ky {
                        for x in dx * kx..(dx + 1) * kx {
                            sum += u32::from(raw[y * stride + x * 3 + c]);
                        }
                    }
                    let v = if (kx, ky) == (2, 2) {
                        (sum + 2) >> 2
                    } else {
                        (sum as f32 * inv_area).round_ties_even() as u32
                    };
                    out.push(v.min(255) as u8);
                }
            }
        }
        return RgbImage::from_raw(w, h, out).expect("w x h x 3 bytes");
    }
    let (xs, ys) = (area_weights(sw, w, scale_x), area_weights(sh, h, scale_y));
    let width = w as usize * 3;
    let (mut buf, mut sum) = (vec![0f32; width], vec![0f32; width]);
    let mut out = vec![0u8; width * h as usize];
    let mut store = |dy: usize, sum: &[f32]| {
        for (o, v) in out[dy * width..(dy + 1) * width].iter_mut().zip(sum) {
            *o = v.round_ties_even().clamp(0.0, 255.0) as u8;
        }
    };
    let mut prev = ys.first().map_or(0, |t| t.0);
    for &(dy, sy, beta) in &ys {
        buf.fill(0.0);
        let line = &raw[sy * stride..(sy + 1) * stride];
        for &(dx, sx, alpha) in &xs {
            for c in 0..3 {
                buf[dx * 3 + c] += f32::from(line[sx * 3 + c]) * alpha;
            }
        }
        if dy != prev {
            store(prev, &sum);
            for (s, b) in sum.iter_mut().zip(&buf) {
                *s = beta * b;
            }
            prev = dy;
        } else {
            for (s, b) in sum.iter_mut().zip(&buf) {
                *s += beta * b;
            }
        }
    }
    store(prev, &sum);
    RgbImage::from_raw(w, h, out).expect("w x h x 3 bytes")
}

/// OpenCV's table for shrinking `src` pixels to `dst` by area (`computeResizeAreaTab`): for each
/// output pixel, the source pixels it covers with the share of each, as (output, source, weight).
fn area_weights(src: u32, dst: u32, scale: f64) -> Vec<(usize, usize, f32)> {
    let mut tab = Vec::new();
    let src_f = f64::from(src);
    for d in 0..dst as usize {
        let fs1 = d as f64 * scale;
        let fs2 = fs1 + scale;
        let cell = scale.min(src_f - fs1);
        let s2 = (fs2.floor() as i64).min(i64::from(src) - 1);
        let s1 = (fs1.ceil() as i64).min(s2);
        if s1 as f64 - fs1 > 1e-3 {
            tab.push((d, (s1 - 1) as usize, ((s1 as f64 - fs1) / cell) as f32));
        }
        for s in s1..s2 {
            tab.push((d, s as usize, (1.0 / cell) as f32));
        }
        if fs2 - s2 as f64 > 1e-3 {
            tab.push((d, s2 as usize, ((fs2 - s2 as f64).min(1.0).min(cell) / cell) as f32));
        }
    }
    tab
}

/// `cv2.resize(img, (w, h), interpolation=cv2.INTER_NEAREST)`: output pixel `d` takes source
/// pixel `floor(d * src / dst)` on each axis.
fn opencv_nearest(src: &RgbImage, w: u32, h: u32) -> RgbImage {
    let picks = |dst: u32, src: u32| {
        let scale = 1.0 / (f64::from(dst) / f64::from(src));
        (0..dst).map(|d| ((f64::from(d) * scale).floor() as u32).min(src - 1)).collect::<Vec<u32>>()
    };
    let (sw, sh) = src.dimensions();
    pick(src, &picks(w, sw), &picks(h, sh))
}

/// The image of `src`'s pixels at columns `xs` and rows `ys` (a nearest-neighbour resize).
fn pick(src: &RgbImage, xs: &[u32], ys: &[u32]) -> RgbImage {
    RgbImage::from_fn(xs.len() as u32, ys.len() as u32, |x, y| *src.get_pixel(xs[x as usize], ys[y as usize]))
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
pub enum Layout {
    #[default]
    #[serde(rename = "NCHW")]
    Nchw,
    #[serde(rename = "NHWC")]
    Nhwc,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
pub enum Channels {
    #[default]
    #[serde(rename = "RGB")]
    Rgb,
    #[serde(rename = "BGR")]
    Bgr,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NormalizeConfig {
    pub name: Option<String>,
    pub input: Option<String>,
    /// The tensor it writes (default `pixels`).
    pub output: Option<String>,
    /// Each pixel value is multiplied by `scale` (default 1/255), then `(v - mean) / std` per channel.
    pub scale: Option<f32>,
    pub mean: Option<Vec<f32>>,
    pub std: Option<Vec<f32>>,
    #[serde(default, deserialize_with = "super::any_case")]
    pub channels: Channels,
    #[serde(default, deserialize_with = "super::any_case")]
    pub layout: Layout,
    /// FP32 (default), FP16 or UINT8 (the pixel values as they are: scale, mean and std unused).
    pub dtype: Option<String>,
}

pub(crate) struct Normalize {
    input: String,
    output: String,
    scale: f32,
    mean: [f32; 3],
    std: [f32; 3],
    channels: Channels,
    layout: Layout,
    dtype: DataType,
}

impl Normalize {
    pub fn new(c: &NormalizeConfig) -> Result<Normalize> {
        let three = |v: &Option<Vec<f32>>, default: f32, what: &str| -> Result<[f32; 3]> {
            match v.as_deref() {
                None => Ok([default; 3]),
                Some([a]) => Ok([*a; 3]),
                Some([a, b, c]) => Ok([*a, *b, *c]),
                Some(_) => Err(Error::invalid(format!("{what} takes 1 or 3 numbers"))),
            }
        };
        let std = three(&c.std, 1.0, "std")?;
        if std.contains(&0.0) {
            return Err(Error::invalid("std must not be 0"));
        }
        let dtype = match c.dtype.as_deref().unwrap_or("FP32").to_ascii_uppercase().as_str() {
            "FP32" => DataType::Fp32,
            "FP16" => DataType::Fp16,
            "UINT8" => DataType::Uint8,
            other => return Err(Error::invalid(format!("dtype '{other}': FP32, FP16 or UINT8"))),
        };
        Ok(Normalize {
            input: c.input.clone().unwrap_or_else(|| "image".into()),
            output: c.output.clone().unwrap_or_else(|| "pixels".into()),
            scale: c.scale.unwrap_or(1.0 / 255.0),
            mean: three(&c.mean, 0.0, "mean")?,
            std,
            channels: c.channels,
            layout: c.layout,
            dtype,
        })
    }

    pub fn kind(&self, size: Option<(u32, u32)>) -> Kind {
        let (w, h) = size.map_or((-1, -1), |(w, h)| (w as i64, h as i64));
        let dims = match self.layout {
            Layout::Nchw => vec![3, h, w],
            Layout::Nhwc => vec![h, w, 3],
        };
        Kind::Tensor(self.dtype, dims)
    }

    pub fn run(&self, values: &mut BTreeMap<String, Value>) -> Result<(), StepError> {
        let Some(Value::Images(pictures)) = values.get(&self.input) else {
            return Err(StepError::Batch(Error::internal(format!("'{}' is not an image", self.input))));
        };
        let rows = per_row(pictures, |p| Ok(self.tensor(&p.pixels)))?;
        values.insert(self.output.clone(), Value::Rows(rows));
        Ok(())
    }

    fn tensor(&self, img: &RgbImage) -> Tensor {
        let (w, h) = img.dimensions();
        let (w, h) = (w as usize, h as usize);
        let order: [usize; 3] = match self.channels {
            Channels::Rgb => [0, 1, 2],
            Channels::Bgr => [2, 1, 0],
        };
        let shape = match self.layout {
            Layout::Nchw => vec![3, h, w],
            Layout::Nhwc => vec![h, w, 3],
        };
        let raw = img.as_raw();
        // Index of the value for channel slot c at pixel i, in the output.
        let at = |c: usize, i: usize| match self.layout {
            Layout::Nchw => c * w * h + i,
            Layout::Nhwc => i * 3 + c,
        };
        if self.dtype == DataType::Uint8 {
            let mut out = vec![0u8; w * h * 3];
            for (i, px) in raw.chunks_exact(3).enumerate() {
                for (c, &src) in order.iter().enumerate() {
                    out[at(c, i)] = px[src];
                }
            }
            return Tensor::new(&self.output, DataType::Uint8, shape, TensorData::Fixed(out.into()));
        }
        // A table per channel: 256 values, computed once.
        let table: Vec<[f32; 256]> = order
            .iter()
            .map(|&src| std::array::from_fn(|v| (v as f32 * self.scale - self.mean[src]) / self.std[src]))
            .collect();
        let mut out = vec![0f32; w * h * 3];
        for (i, px) in raw.chunks_exact(3).enumerate() {
            for (c, &src) in order.iter().enumerate() {
                out[at(c, i)] = table[c][px[src] as usize];
            }
        }
        if self.dtype == DataType::Fp16 {
            let halves: Vec<half::f16> = out.iter().map(|&v| half::f16::from_f32(v)).collect();
            return Tensor::from_le(&self.output, DataType::Fp16, shape, &halves);
        }
        Tensor::from_le(&self.output, DataType::Fp32, shape, &out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(w: u32, h: u32) -> Vec<u8> {
        let mut out = Vec::new();
        image::GrayImage::new(w, h).write_to(&mut Cursor::new(&mut out), image::ImageFormat::Png).unwrap();
        out
    }

    fn jpeg(w: u32, h: u32) -> Vec<u8> {
        let mut out = Vec::new();
        RgbImage::from_pixel(w, h, image::Rgb([200, 10, 10]))
            .write_to(&mut Cursor::new(&mut out), image::ImageFormat::Jpeg)
            .unwrap();
        out
    }

    fn decode() -> Decode {
        Decode::new(&DecodeConfig {
            name: None,
            input: "image".into(),
            output: None,
            max_bytes: None,
            max_pixels: None,
            max_side: None,
            max_request_pixels: None,
            max_scans: None,
            alpha: Alpha::default(),
        })
        .unwrap()
    }

    #[test]
    fn alpha_is_composited_or_dropped_as_asked() {
        let mut png = Vec::new();
        image::RgbaImage::from_pixel(1, 1, image::Rgba([200, 100, 50, 128]))
            .write_to(&mut Cursor::new(&mut png), image::ImageFormat::Png)
            .unwrap();
        let pixel = |alpha| Decode { alpha, ..decode() }.decode(&png).unwrap().pixels.get_pixel(0, 0).0;
        assert_eq!(pixel(Alpha::OverWhite), [227, 177, 152]);
        assert_eq!(pixel(Alpha::OverBlack), [100, 50, 25]);
        assert_eq!(pixel(Alpha::Drop), [200, 100, 50], "as Pillow's convert(\"RGB\") and cv2.imread give it");
    }

    #[test]
    fn sides_and_area_are_read_from_the_header_and_bounded() {
        let d = decode();
        assert_eq!(d.declared(&png(300, 2)).unwrap(), (300, 2));
        let e = d.declared(&png(20000, 1)).unwrap_err().to_string();
        assert!(e.contains("max_side"), "{e}");
        assert!(d.decode(&png(16000, 3)).is_ok());
    }

    #[test]
    fn jpeg_scans_are_counted_and_a_cut_file_is_refused() {
        let whole = jpeg(16, 16);
        assert!(jpeg_scans(&whole, 1).is_ok());
        let e = jpeg_scans(&whole[..whole.len() / 2], 32).unwrap_err().to_string();
        assert!(e.contains("truncated"), "{e}");
        // The one scan repeated past the limit.
        let sos = whole.windows(2).position(|w| w == [0xFF, 0xDA]).unwrap();
        let scan = &whole[sos..whole.len() - 2];
        let mut many = whole[..whole.len() - 2].to_vec();
        for _ in 0..40 {
            many.extend_from_slice(scan);
        }
        many.extend_from_slice(&[0xFF, 0xD9]);
        let e = jpeg_scans(&many, 32).unwrap_err().to_string();
        assert!(e.contains("more than 32 scans"), "{e}");
        assert!(jpeg_scans(&many, 64).is_ok());
    }

    #[test]
    fn a_resize_past_the_bounds_is_refused_before_it_allocates() {
        let line = Picture {
            pixels: RgbImage::new(16000, 1),
            geometry: Geometry { sent: (16000, 1), scale: (1.0, 1.0), offset: (0.0, 0.0) },
        };
        let shorter = ResizeConfig {
            name: None,
            input: None,
            output: None,
            mode: ResizeMode::ShorterSide,
            size: vec![256],
            filter: Filter::Bilinear,
            antialias: true,
        };
        let (op, _) = ImageOp::resize(&shorter, None).unwrap();
        let e = op.with_input("image").apply(&line).err().unwrap().to_string();
        assert!(e.contains("4096000x256, more than 16384 on a side"), "{e}");
        // Within the sides, the first pass (source width x output height) is what is bounded.
        let exact = ResizeConfig { mode: ResizeMode::Exact, size: vec![16, 8000], ..shorter };
        let (op, _) = ImageOp::resize(&exact, None).unwrap();
        let e = op.with_input("image").apply(&line).err().unwrap().to_string();
        assert!(e.contains("needs more than"), "{e}");
        assert!(pair(&[16384, 16384], "size").is_err());
        assert!(pair(&[8000, 8000], "size").is_ok());
    }
}
