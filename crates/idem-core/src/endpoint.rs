//! Store endpoints in messages: a URL with its credentials taken out.
//!
//! A connect error names the endpoint it tried, so an operator sees which Redis or
//! PostgreSQL did not answer; the URL's user, password and query (where PostgreSQL URLs
//! can carry `password=`) never reach a log line.

/// `url` with its user info replaced by `***` and its query and fragment by `?…`:
/// `redis://:secret@cache:6379/0` becomes `redis://***@cache:6379/0`,
/// `postgres://app:pw@db/shop?sslmode=require&password=x` becomes
/// `postgres://***@db/shop?…`. A string that is not a URL and has an `@` keeps only
/// what follows its last `@`.
///
/// ```
/// use idem_core::endpoint::redacted;
/// assert_eq!(redacted("redis://:secret@cache:6379/0"), "redis://***@cache:6379/0");
/// assert_eq!(redacted("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
/// assert_eq!(redacted("postgres://db/shop?password=x"), "postgres://db/shop?…");
/// ```
pub fn redacted(url: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(i) => (&url[..i + 3], &url[i + 3..]),
        None => ("", url),
    };
    let (rest, query) = match rest.find(['?', '#']) {
        Some(i) => (&rest[..i], "?…"),
        None => (rest, ""),
    };
    match rest.rfind('@') {
        Some(at) => format!("{scheme}***@{}{query}", &rest[at + 1..]),
        None => format!("{scheme}{rest}{query}"),
    }
}

/// Several endpoints (a cluster's seed nodes), each [`redacted`], comma-separated.
pub fn redacted_list<S: AsRef<str>>(urls: &[S]) -> String {
    urls.iter()
        .map(|u| redacted(u.as_ref()))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_never_survive() {
        for (url, want) in [
            ("redis://:s3cret@h:6379/0", "redis://***@h:6379/0"),
            ("redis://user:s3cret@h:6379", "redis://***@h:6379"),
            ("rediss://user@h", "rediss://***@h"),
            // An unencoded `@` or `/` in the password: everything up to the last `@` goes.
            ("redis://u:p@ss/w@h:1/0", "redis://***@h:1/0"),
            (
                "postgres://app:s3cret@db:5432/shop?sslmode=disable",
                "postgres://***@db:5432/shop?…",
            ),
            (
                "postgresql://db/shop?user=app&password=s3cret",
                "postgresql://db/shop?…",
            ),
            (
                "redis+unix:///run/redis.sock",
                "redis+unix:///run/redis.sock",
            ),
            ("s3cret@host", "***@host"),
            ("h:6379", "h:6379"),
        ] {
            let got = redacted(url);
            assert_eq!(got, want, "{url}");
            assert!(!got.contains("s3cret"), "{got}");
        }
        assert_eq!(
            redacted_list(&["redis://:a@n1:7000", "redis://n2:7000"]),
            "redis://***@n1:7000,redis://n2:7000"
        );
    }
}
