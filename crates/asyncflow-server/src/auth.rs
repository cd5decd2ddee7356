//! Token checks. The comparison takes the same time whatever the first differing byte, so a
//! client cannot learn the token one byte at a time from response times.

/// Whether `presented` equals `expected`, in time that depends only on their lengths.
pub fn token_matches(expected: &str, presented: Option<&str>) -> bool {
    let Some(presented) = presented else {
        return false;
    };
    let (a, b) = (expected.as_bytes(), presented.as_bytes());
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0xff);
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::token_matches;

    #[test]
    fn only_the_exact_token_matches() {
        assert!(token_matches("s3cret", Some("s3cret")));
        assert!(!token_matches("s3cret", Some("s3cre")));
        assert!(!token_matches("s3cret", Some("s3cret!")));
        assert!(!token_matches("s3cret", Some("S3cret")));
        assert!(!token_matches("s3cret", None));
        assert!(!token_matches("", Some("\u{ff}")));
    }
}
